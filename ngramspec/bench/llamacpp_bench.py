"""bench llamacpp: our plain and speculative decoding against llama.cpp plain, on the same GGUF.

Whole requests, greedy, the same chat-templated token ids (the recorded prompts in
`data/streams/*.jsonl`), prompt by prompt, rotating who goes first; tok/s = generated tokens /
wall time including prefill. Every prompt's speculative output is checked equal to our plain
output. Then the context curve: plain decode ms/token at each context length, and the verify
cost of q tokens in one forward (one llama.cpp batch) relative to one token.
With `--concurrency C > 1`, also C requests at once: ours through continuous batching, llama.cpp
as C parallel sequences in one context (one batch per step, greedy on its logits), in two rounds
(the second in reverse order), each engine's best round reported. The batch takes
the prompts the one-at-a-time phase did not answer first (code_edit has only 6, so they repeat),
and our engines forget that phase first (prefix cache and learned n-grams): otherwise our batch
would skip prefills llama.cpp pays and draft from answers it already gave to the same prompts.

llama.cpp comes from `llama-cpp-python` (optional extra `ngramspec[llamacpp]`; it compiles
llama.cpp from source, about 6 minutes here).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ngramspec.bench import WEIGHT_MODES, emit
from ngramspec.bench.context_bench import QUERY_TOKENS, prefill_and_decode, synthetic_prompt
from ngramspec.bench.quality_bench import matching_prefix
from ngramspec.engine.cost_model import time_forward
from ngramspec.kernels import kernel_path
from ngramspec.llm import LLM
from ngramspec.models.loader import gguf_file
from ngramspec.sampling_params import SamplingParams

STREAMS = Path(__file__).resolve().parents[2] / "data" / "streams"
# workload -> (stream file, tokens per request, prompts kept: None = all, "category" = one each)
WORKLOADS = {"code_edit": ("code_edit.jsonl", 320, None),
             "spec_bench": ("spec_bench.jsonl", 96, "category")}


def _stream_rows(streams: Path, workload: str) -> list[dict[str, Any]]:
    """The workload's recorded streams, in file order."""
    text = (streams / WORKLOADS[workload][0]).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_prompts(streams: Path, workload: str, limit: int | None) -> list[tuple[str, list[int]]]:
    keep = WORKLOADS[workload][2]
    rows = _stream_rows(streams, workload)
    if keep == "category":
        seen: set[str] = set()
        rows = [r for r in rows if not (r["category"] in seen or seen.add(r["category"]))]
    return [(r["id"], r["prompt_ids"]) for r in rows][:limit]


class LlamaCpp:
    """llama.cpp through llama-cpp-python: plain greedy decoding of token ids."""

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise SystemExit("bench llamacpp needs llama-cpp-python: "
                             "pip install 'ngramspec[llamacpp]' (builds llama.cpp, ~6 min)") from e
        self.path, self.threads = path, threads
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def generate(self, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
        self.llm.reset()  # no prefix reuse between requests: every request pays its prefill
        out: list[int] = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=False):
            if tok in eos:
                break
            out.append(tok)
            if len(out) == max_tokens:
                break
        return out

    def decode_ms(self, context: int, tokens: int, repeats: int, vocab: int) -> float:
        prompt = synthetic_prompt(context, vocab)
        best = float("inf")
        for _ in range(repeats):
            self.llm.reset()
            self.llm.eval(prompt)
            t = time.perf_counter()
            for i in range(tokens):
                self.llm.eval([prompt[i]])
            best = min(best, (time.perf_counter() - t) / tokens)
        return 1000 * best

    def verify_ms(self, context: int, q: int, repeats: int, vocab: int) -> float:
        """One batch of q new tokens over a cached context (what verifying a q-token draft costs)."""
        prompt = synthetic_prompt(context + q, vocab)
        self.llm.reset()
        self.llm.eval(prompt[:context])
        best = float("inf")
        for _ in range(repeats):
            self.llm.n_tokens = context  # eval() drops the cached K/V past n_tokens
            t = time.perf_counter()
            self.llm.eval(prompt[context:])
            best = min(best, time.perf_counter() - t)
        return 1000 * best

    def generate_parallel(self, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> int:
        """len(prompts) sequences in one llama.cpp context, one batch per step; tokens generated."""
        import llama_cpp
        from llama_cpp import _internals

        n = len(prompts)
        params = llama_cpp.llama_context_default_params()
        per_seq = max(len(p) for p in prompts) + max_tokens + 8
        params.n_ctx = n * per_seq  # llama.cpp splits the context evenly over the sequences
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = n
        params.n_threads = params.n_threads_batch = self.threads
        ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=n, verbose=False)
        vocab = self.llm.n_vocab()
        try:
            pos = [0] * n
            last = [0] * n
            for s, p in enumerate(prompts):  # prefill each sequence in chunks of the batch
                for i in range(0, len(p), 512):
                    chunk = p[i : i + 512]
                    _fill(batch, [(t, pos[s] + j, s, j == len(chunk) - 1 and i + 512 >= len(p))
                                  for j, t in enumerate(chunk)])
                    ctx.decode(batch)
                    pos[s] += len(chunk)
                last[s] = _argmax(ctx, len(chunk) - 1, vocab)
            live, made = list(range(n)), [1] * n
            while True:
                live = [s for s in live if last[s] not in eos and made[s] < max_tokens]
                if not live:
                    return sum(made)
                _fill(batch, [(last[s], pos[s], s, True) for s in live])
                ctx.decode(batch)
                for row, s in enumerate(live):
                    pos[s] += 1
                    last[s] = _argmax(ctx, row, vocab)
                    made[s] += 1
        finally:
            batch.close()
            ctx.close()


def _fill(batch: Any, rows: list[tuple[int, int, int, bool]]) -> None:
    """(token, position, sequence, wants logits) rows into a llama_batch."""
    b = batch.batch
    for i, (tok, pos, seq, logits) in enumerate(rows):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
        b.seq_id[i][0] = seq
    b.n_tokens = len(rows)


def _argmax(ctx: Any, row: int, vocab: int) -> int:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(ctx.ctx, row)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))


def _ours(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    llm.engine.scheduler.flush_cache()  # as llama.cpp's reset: every request pays its prefill
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids


def _timed(fn, *args) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def run_workload(engines: dict[str, Any], prompts: list[tuple[str, list[int]]], max_tokens: int,
                 eos: set[int]) -> dict[str, Any]:
    calls = {"llama.cpp": lambda p: engines["llama.cpp"].generate(p, max_tokens, eos),
             "plain": lambda p: _ours(engines["plain"], p, max_tokens),
             "spec": lambda p: _ours(engines["spec"], p, max_tokens)}
    names = list(calls)
    tokens = dict.fromkeys(names, 0)
    wall = dict.fromkeys(names, 0.0)
    rows = []
    for i, (pid, prompt) in enumerate(prompts):
        order = names[i % 3:] + names[: i % 3]  # rotate who goes first
        outs = {}
        for name in order:
            outs[name], dt = _timed(calls[name], prompt)
            tokens[name] += len(outs[name])
            wall[name] += dt
        rows.append({"id": pid, "tokens": {n: len(outs[n]) for n in names},
                     "spec_equals_plain": outs["spec"] == outs["plain"],
                     "llama_matching_prefix": matching_prefix(outs["llama.cpp"], outs["plain"])})
    tok_s = {n: tokens[n] / wall[n] for n in names}
    return {"prompts": rows, "tok_s": tok_s,
            "ratio_vs_llama": {n: tok_s[n] / tok_s["llama.cpp"] for n in ("plain", "spec")},
            "spec_equals_plain": sum(r["spec_equals_plain"] for r in rows),
            "num_prompts": len(rows)}


def concurrent_prompts(streams: Path, workload: str, count: int,
                       answered: set[str]) -> list[list[int]]:
    """`count` prompts of the workload's file: first those the one-at-a-time phase did not
    answer, then the others, then again from the start (code_edit has 6)."""
    rows = _stream_rows(streams, workload)
    rows.sort(key=lambda r: r["id"] in answered)  # stable: file order within each part
    return [rows[i % len(rows)]["prompt_ids"] for i in range(count)]


def forget_earlier_requests(llm: LLM) -> None:
    """Empty the prefix cache (llama.cpp prefills every request) and what the drafter learned
    from earlier answers, so a batch neither skips prefills nor copies answers it saw before."""
    llm.engine.scheduler.flush_cache()
    if llm.engine.speculator is not None:
        llm.engine.speculator.drafter.reset()


def run_concurrent(engines: dict[str, Any], prompts: list[list[int]], max_tokens: int,
                   eos: set[int], rounds: int = 2) -> dict[str, Any]:
    """The batch `rounds` times, every other round in reverse order (so plain and spec take turns
    going first); each engine's best round counts, as timeit's (on a shared machine noise only
    adds time). Every round's tok/s is in the JSON."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    names = ["llama.cpp", "plain", "spec"]
    runs: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            if name == "llama.cpp":
                made, dt = _timed(engines[name].generate_parallel, prompts, max_tokens, eos)
            else:
                forget_earlier_requests(engines[name])  # each round starts from nothing
                res, dt = _timed(engines[name].generate, prompts, params)
                made = sum(len(r.token_ids) for r in res)
            runs[name].append(made / dt)
    out = {name: max(tok_s) for name, tok_s in runs.items()}
    return {"tok_s": out, "ratio_vs_llama": {n: out[n] / out["llama.cpp"] for n in ("plain", "spec")},
            "rounds_tok_s": runs, "distinct_prompts": len({tuple(p) for p in prompts})}


def run_contexts(engines: dict[str, Any], contexts: list[int], tokens: int,
                 repeats: int) -> dict[str, Any]:
    plain, llama = engines["plain"], engines["llama.cpp"]
    vocab = plain.engine.model_cfg.vocab_size
    rows = {}
    for ctx in contexts:
        ours_v = {q: time_forward(plain.engine.runner, plain.engine.scheduler, 1, q, ctx, repeats)
                  for q in QUERY_TOKENS}
        llama_v = {q: llama.verify_ms(ctx, q, repeats, vocab) for q in QUERY_TOKENS}
        ours_ms = prefill_and_decode(plain, ctx, tokens, repeats)[1]
        llama_ms = llama.decode_ms(ctx, tokens, repeats, vocab)
        rows[ctx] = {"ours_ms": ours_ms, "llama_ms": llama_ms, "ratio": ours_ms / llama_ms,
                     "ours_verify_rel": {str(q): ours_v[q] / ours_v[1] for q in QUERY_TOKENS},
                     "llama_verify_rel": {str(q): llama_v[q] / llama_v[1] for q in QUERY_TOKENS}}
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = gguf_file(args.model)
    if path is None:
        raise SystemExit("bench llamacpp needs a .gguf model (llama.cpp runs the same file)")
    n_ctx = max([*args.contexts, 4096]) + 64
    opts = dict(WEIGHT_MODES[args.mode], num_threads=args.threads, max_model_len=n_ctx)
    plain = LLM(str(path), **opts)
    spec = LLM(str(path), speculative="ngram", **opts)
    engines = {"llama.cpp": LlamaCpp(path, n_ctx, args.threads), "plain": plain, "spec": spec}
    eos = set(plain.engine.eos_token_ids)
    warm = [1, 2, 3, 4, 5, 6, 7, 8]
    for name in ("plain", "spec"):
        _ours(engines[name], warm, 8)
    engines["llama.cpp"].generate(warm, 8, eos)
    result: dict[str, Any] = {"mode": args.mode, "threads": args.threads, "model": path.name,
                              "kernels": kernel_path(),
                              "workloads": {}}
    for workload in args.workloads:
        prompts = load_prompts(Path(args.streams), workload, args.limit)
        max_tokens = args.max_tokens or WORKLOADS[workload][1]
        result["workloads"][workload] = run_workload(engines, prompts, max_tokens, eos)
        if args.concurrency > 1:
            ids = concurrent_prompts(Path(args.streams), workload, args.concurrency,
                                     {pid for pid, _ in prompts})
            result["workloads"][workload]["concurrent"] = dict(
                run_concurrent(engines, ids, max_tokens, eos), concurrency=args.concurrency)
    if args.contexts:
        result["contexts"] = run_contexts(engines, args.contexts, args.tokens, args.repeats)
    return result


def print_results(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    table = Table(title=f"whole requests, greedy, {r['threads']} threads, ours in {r['mode']} mode "
                        f"(CPU kernels: {r['kernels']})")
    for col in ("workload", "llama.cpp tok/s", "ours plain", "ours spec", "spec == plain"):
        table.add_column(col, justify="right")
    for name, w in r["workloads"].items():
        t, x = w["tok_s"], w["ratio_vs_llama"]
        table.add_row(f"{name} ({w['num_prompts']})", f"{t['llama.cpp']:.1f}",
                      f"{t['plain']:.1f} ({x['plain']:.2f}x)", f"{t['spec']:.1f} ({x['spec']:.2f}x)",
                      f"{w['spec_equals_plain']}/{w['num_prompts']}")
        if "concurrent" in w:
            c = w["concurrent"]
            t, x = c["tok_s"], c["ratio_vs_llama"]
            table.add_row(f"{name} x{c['concurrency']} at once ({c['distinct_prompts']} distinct)",
                          f"{t['llama.cpp']:.1f}",
                          f"{t['plain']:.1f} ({x['plain']:.2f}x)",
                          f"{t['spec']:.1f} ({x['spec']:.2f}x)", "")
    console.print(table)
    if "contexts" in r:
        table = Table(title="plain decode ms/token by context; verify cost of q tokens / 1 token")
        for col in ("context", "llama.cpp ms", "ours ms", "ours/llama", "llama q=2/4/8/16",
                    "ours q=2/4/8/16"):
            table.add_column(col, justify="right")
        for ctx, row in r["contexts"].items():
            lv = "/".join(f"{row['llama_verify_rel'][str(q)]:.2f}" for q in QUERY_TOKENS[1:])
            ov = "/".join(f"{row['ours_verify_rel'][str(q)]:.2f}" for q in QUERY_TOKENS[1:])
            table.add_row(str(ctx), f"{row['llama_ms']:.1f}", f"{row['ours_ms']:.1f}",
                          f"{row['ratio']:.2f}x", lv, ov)
        console.print(table)


def run_llamacpp_bench(args: argparse.Namespace) -> int:
    return emit(run(args), args.json, print_results)


def register(subparsers: Any) -> None:
    """Add `llamacpp` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("llamacpp", help="ours plain/speculative vs llama.cpp on one GGUF",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    p.add_argument("--mode", choices=sorted(WEIGHT_MODES), default="gguf", help="our weight mode")
    p.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS),
                   default=["code_edit", "spec_bench"])
    p.add_argument("--streams", default=str(STREAMS), help="folder of recorded prompt streams")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts a workload")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per request (default: code_edit 320, spec_bench 96)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="also run this many requests at once (llama.cpp: parallel sequences)")
    p.add_argument("--contexts", nargs="*", type=int, default=[128, 512, 1024, 2048, 3500])
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per context timing")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_llamacpp_bench)
