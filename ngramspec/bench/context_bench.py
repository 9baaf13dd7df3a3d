"""bench context: plain decode ms/token and the verify curve by context length, per weight mode.

Prefill: the prompt's prefill to its first token (prefix cache flushed), as prompt tokens/s.
Decode: `--tokens` batch-1 greedy decode steps after the prompt's prefill and first token, timed
on their own, best of `--repeats`. Verify curve: one forward of q query tokens over a
cached context of that length, relative to q = 1 (`engine/cost_model.time_forward`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ngramspec.bench import WEIGHT_MODES, emit
from ngramspec.engine.cost_model import time_forward
from ngramspec.kernels import kernel_path
from ngramspec.llm import LLM
from ngramspec.sampling_params import SamplingParams

QUERY_TOKENS = (1, 2, 4, 8, 16)


def synthetic_prompt(length: int, vocab: int) -> list[int]:
    """Fixed token ids of any length, no tokenizer needed (the same for every engine)."""
    return [(i * 7919) % (vocab - 100) + 100 for i in range(length)]


def prefill_and_decode(llm: LLM, context: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(prefill prompt tokens/s, decode ms/token) of a `context`-token prompt: the prefill to the
    first token with the prefix cache flushed, then plain decode steps timed alone (as
    llama.cpp's side is); best of `repeats` after a warm-up."""
    prompt = synthetic_prompt(context, llm.engine.model_cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine, best, best_prefill = llm.engine, float("inf"), float("inf")
    for r in range(repeats + 1):
        engine.scheduler.flush_cache()
        t = time.perf_counter()
        engine.add_request(f"bench-context-{context}-{r}", prompt, params)
        while not any(out.new_token_ids for out in engine.step()):
            pass  # prefill chunks, then the first token
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if r:
            best = min(best, (time.perf_counter() - t) / tokens)
            best_prefill = min(best_prefill, prefill)
    return context / best_prefill, 1000 * best


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in args.modes:
        llm = LLM(args.model, **WEIGHT_MODES[mode], num_threads=args.threads,
                  max_model_len=max(args.contexts) + 2 * args.tokens + 64)
        engine = llm.engine
        rows = {}
        for ctx in args.contexts:
            verify = {q: time_forward(engine.runner, engine.scheduler, 1, q, ctx, repeats=3)
                      for q in QUERY_TOKENS}
            prefill, decode = prefill_and_decode(llm, ctx, args.tokens, args.repeats)
            rows[ctx] = {"prefill_tok_s": prefill, "decode_ms": decode,
                         "verify_rel": {q: verify[q] / verify[1] for q in QUERY_TOKENS}}
        out[mode] = rows
    return {"kernels": kernel_path(), "modes": out}


def print_results(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="prefill tok/s, plain decode ms/token and verify cost (q tokens / 1 token) "
                        f"by context, CPU kernels: {r['kernels']}")
    columns = ("mode", "context", "prefill tok/s", "decode ms/token", *(f"q={q}" for q in QUERY_TOKENS[1:]))
    for col in columns:
        table.add_column(col, justify="right")
    for mode, rows in r["modes"].items():
        for ctx, row in rows.items():
            table.add_row(mode, str(ctx), f"{row['prefill_tok_s']:.0f}", f"{row['decode_ms']:.1f}",
                          *(f"{row['verify_rel'][q]:.2f}x" for q in QUERY_TOKENS[1:]))
    Console().print(table)


def run_context_bench(args: argparse.Namespace) -> int:
    return emit(run(args), args.json, print_results)


def register(subparsers: Any) -> None:
    """Add `context` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("context", help="decode ms/token and verify curve by context length",
                              description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", choices=sorted(WEIGHT_MODES), default=["float32", "gguf"])
    p.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1024, 2048, 3500])
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per timing")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_context_bench)
