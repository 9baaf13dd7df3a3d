"""bench quality: how far a faster weight mode (bfloat16, GGUF blocks, ...) drifts from float32.

On held prompts (one Spec-Bench prompt per category, chat template), float32 decodes greedily;
then both modes score float32's own tokens (teacher forcing), so every position is compared on
the same context. Reported per mode: the share of positions whose argmax agrees with float32's,
the mean KL(float32 || mode) of the next-token distributions, and how many tokens free-running
greedy decoding in the mode matches float32 before the first difference.

With `--llama-server PATH`, llama.cpp's own server on the same GGUF file is a row too: its greedy
next token after each prefix of float32's output (one request a position, its prompt cache on),
and its free-running output. That is the agreement every GGUF user already accepts, the bar for
EngineConfig.gguf_activations' default.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ngramspec.bench import WEIGHT_MODES, emit
from ngramspec.bench.workloads import limit_per_category, spec_bench
from ngramspec.engine.model_runner import ForwardItem
from ngramspec.llm import LLM
from ngramspec.sampling_params import SamplingParams


@dataclass(slots=True)
class ModeQuality:
    mode: str
    positions: int
    argmax_agreement: float
    mean_kl: float | None  # None where only argmaxes are known (llama-server)
    mean_matching_prefix: float  # free-running greedy tokens equal to float32's, per prompt


def score(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities after every position of `token_ids`: [len, vocab] float32."""
    engine = llm.engine
    n = len(token_ids)
    with engine.scheduler.scratch_slots(n) as slots:
        item = ForwardItem(token_ids, list(range(n)), [], slots, None, list(range(n)))
        return torch.log_softmax(engine.runner.run([item]).float(), -1)


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(ref: LLM, other: LLM, prompts: list[list[int]], max_tokens: int,
            mode: str) -> ModeQuality:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ref_out = [o.token_ids for o in ref.generate(prompts, params)]
    other_out = [o.token_ids for o in other.generate(prompts, params)]
    agree, kl, positions = 0, 0.0, 0
    for prompt, out in zip(prompts, ref_out):
        ids = prompt + out
        first = len(prompt) - 1  # the row that predicts the first output token
        p = score(ref, ids)[first:-1]  # [len(out), vocab]
        q = score(other, ids)[first:-1]
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        positions += len(out)
    prefix = sum(matching_prefix(a, b) for a, b in zip(ref_out, other_out)) / len(prompts)
    return ModeQuality(mode, positions, agree / max(positions, 1), kl / max(positions, 1), prefix)


def _llama_greedy(port: int, prompt: list[int], n: int) -> list[int]:
    """llama-server's greedy continuation of `prompt` (token ids), n tokens."""
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": True,
                       "return_tokens": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return [int(t) for t in json.loads(r.read())["tokens"]]


def compare_llama_server(binary: Path, model: Path, threads: int, ref: LLM,
                         prompts: list[list[int]], max_tokens: int) -> ModeQuality:
    """llama.cpp's server on `model` against float32: argmax after each prefix of float32's
    output, and its free-running greedy output."""
    from ngramspec.bench.llama_server_bench import servers

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ref_out = [o.token_ids for o in ref.generate(prompts, params)]
    server = servers(model, binary, threads, ["plain"], None)[-1]
    with tempfile.TemporaryDirectory() as logs:
        server.start(Path(logs))
        try:
            server.wait_ready(300)
            agree = positions = 0
            prefix = 0
            for prompt, out in zip(prompts, ref_out):
                for i, token in enumerate(out):
                    agree += _llama_greedy(server.port, prompt + out[:i], 1) == [token]
                positions += len(out)
                prefix += matching_prefix(out, _llama_greedy(server.port, prompt, len(out)))
        finally:
            server.stop()
    return ModeQuality("llama-server", positions, agree / max(positions, 1), None,
                       prefix / len(prompts))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ngramspec.models.loader import default_model_path

    questions = limit_per_category(spec_bench(args.spec_bench_path), 1)
    common = dict(model=args.model, num_threads=args.threads)
    ref = LLM(**WEIGHT_MODES["float32"], **common)
    prompts = [ref.apply_chat_template([{"role": "user", "content": q.text}]) for q in questions]
    modes = [compare(ref, LLM(**WEIGHT_MODES[m], **common), prompts, args.max_tokens, m)
             for m in args.modes]
    if args.llama_server is not None:
        model = Path(args.model) if args.model else default_model_path()
        modes.append(compare_llama_server(args.llama_server, model, args.threads or 2, ref, prompts,
                                          args.max_tokens))
    return {"prompts": len(prompts), "max_tokens": args.max_tokens,
            "modes": [asdict(m) for m in modes]}


def print_results(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"quality vs float32: {r['prompts']} prompts, {r['max_tokens']} greedy "
                        "tokens each (teacher-forced on float32's output)")
    for col in ("mode", "positions", "argmax agreement", "mean KL (nats)",
                "free-run matching prefix"):
        table.add_column(col, justify="right")
    for m in r["modes"]:
        kl = "-" if m["mean_kl"] is None else f"{m['mean_kl']:.5f}"
        table.add_row(m["mode"], str(m["positions"]), f"{m['argmax_agreement']:.4f}", kl,
                      f"{m['mean_matching_prefix']:.1f}")
    Console().print(table)


def run_quality_bench(args: argparse.Namespace) -> int:
    return emit(run(args), args.json, print_results)


def register(subparsers: Any) -> None:
    """Add `quality` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("quality", help="greedy agreement and KL of faster modes vs float32",
                              description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", choices=sorted(WEIGHT_MODES), default=["bfloat16", "gguf"],
                   help="modes to compare with float32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--spec-bench-path", default=None)
    p.add_argument("--llama-server", type=Path, default=None,
                   help="a llama.cpp llama-server binary: add its agreement on the same GGUF file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_quality_bench)
