"""`ngramspec bench engine`: plain (non-speculative) decoding throughput, ours vs HF transformers.

Same model file, same prompts (chat-templated questions), same number of torch threads, in one
run; ours in its default mode (for a GGUF model on the CPU: the GGUF block kernels), HF in fp32 on
the dequantised weights (on CUDA, `--device cuda`: both in bf16 on the same GPU): batch 1 (each prompt alone, one after the other) and C concurrent requests (default 16), each
producing exactly --max-tokens new tokens (EOS ignored). HF runs the C requests both as one
left-padded batch and one by one and keeps whichever is faster for it. tok/s counts new tokens
over wall time, prefill included, after a warm-up of both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ngramspec.bench import emit

DEFAULT_QUESTIONS = "/work/shared/data/spec_bench/question.jsonl"


def load_questions(path: str, n: int) -> list[str]:
    """First-turn questions, cycled when the file holds fewer than n."""
    questions = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                questions.append(row["turns"][0] if "turns" in row else row["prompt"])
    if not questions:
        raise ValueError(f"{path}: no questions found")
    return [questions[i % len(questions)] for i in range(n)]


# ----------------------------------------------------------------------------- ours


def ours_tok_s(llm, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> float:
    from ngramspec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    if concurrent:
        outs = llm.generate(prompts, params)
    else:
        outs = [llm.generate(p, params)[0] for p in prompts]
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall


# ----------------------------------------------------------------------------- HF transformers


def _hf_config(max_tokens: int, pad_id: int):
    from transformers import GenerationConfig

    # eos_token_id=[]: never stop early, like ignore_eos on our side.
    return GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=[],
                            pad_token_id=pad_id)


def hf_generate(model, batch: list[list[int]], max_tokens: int, pad_id: int) -> int:
    """One left-padded generate call; returns the number of new tokens."""
    import torch

    width = max(map(len, batch))
    dev = model.device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask,
                             generation_config=_hf_config(max_tokens, pad_id))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # the clock stops when the tokens exist
    return (out.shape[1] - width) * len(batch)


def hf_tok_s(model, prompts: list[list[int]], max_tokens: int, pad_id: int, batched: bool) -> float:
    t0 = time.perf_counter()
    if batched:
        tokens = hf_generate(model, prompts, max_tokens, pad_id)
    else:
        tokens = sum(hf_generate(model, [p], max_tokens, pad_id) for p in prompts)
    return tokens / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- the benchmark


def run_bench(model: str | None, questions: list[str], max_tokens: int, concurrency: int,
              threads: int, hf_sequential_c16: bool = True, device: str = "auto",
              attention_backend: str = "auto", enforce_eager: bool = False) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from ngramspec import LLM
    from ngramspec.models.loader import resolve_model_dir

    llm = LLM(model, num_threads=threads, device=device, attention_backend=attention_backend,
              enforce_eager=enforce_eager)
    dev = llm.engine.runner.device
    torch.set_num_threads(threads)  # HF runs in the same process with the same thread count
    # Each side in its default dtype for the device: bf16 on CUDA (ours too), fp32 on the CPU.
    hf_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(model)),
                                              dtype=hf_dtype).to(dev).eval()
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    chats = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    b1_prompts, c_prompts = chats[: max(1, len(chats) - concurrency)], chats[-concurrency:]
    # Warm-up: first calls pay for kernel selection and allocator growth on both sides.
    ours_tok_s(llm, c_prompts[:4], 8, concurrent=True)
    ours_tok_s(llm, c_prompts[:1], 8, concurrent=False)
    hf_tok_s(hf, c_prompts[:4], 8, pad_id, batched=True)
    hf_tok_s(hf, c_prompts[:1], 8, pad_id, batched=False)

    r: dict[str, Any] = {"device": str(dev), "threads": threads, "max_tokens": max_tokens,
                         "concurrency": concurrency,
                         "num_prompts_b1": len(b1_prompts), "hf_c16_sequential_measured":
                         hf_sequential_c16}
    r["ours_tok_s_b1"] = ours_tok_s(llm, b1_prompts, max_tokens, concurrent=False)
    r["hf_tok_s_b1"] = hf_tok_s(hf, b1_prompts, max_tokens, pad_id, batched=False)
    r["ours_tok_s_c16"] = ours_tok_s(llm, c_prompts, max_tokens, concurrent=True)
    r["hf_tok_s_c16_batched"] = hf_tok_s(hf, c_prompts, max_tokens, pad_id, batched=True)
    if hf_sequential_c16:
        r["hf_tok_s_c16_sequential"] = hf_tok_s(hf, c_prompts, max_tokens, pad_id, batched=False)
    else:  # one by one is exactly the batch-1 procedure: reuse its rate, save the CPU time
        r["hf_tok_s_c16_sequential"] = r["hf_tok_s_b1"]
    r["hf_tok_s_c16"] = max(r["hf_tok_s_c16_batched"], r["hf_tok_s_c16_sequential"])
    r["hf_c16_mode"] = "batched" if r["hf_tok_s_c16_batched"] >= r["hf_tok_s_c16_sequential"] \
        else "sequential"
    r["ratio_b1"] = r["ours_tok_s_b1"] / r["hf_tok_s_b1"]
    r["ratio_c16"] = r["ours_tok_s_c16"] / r["hf_tok_s_c16"]
    r["batching_gain"] = r["ours_tok_s_c16"] / r["ours_tok_s_b1"]
    return r


def print_results(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = r["concurrency"]
    table = Table(title=f"plain decoding on {r['device']}, {r['max_tokens']} new tokens per "
                        f"request, {r['threads']} torch threads")
    for col in ("requests", "ours tok/s", "HF tok/s", "ours / HF"):
        table.add_column(col, justify="left" if col == "requests" else "right")
    table.add_row(f"1 at a time ({r['num_prompts_b1']} prompts)", f"{r['ours_tok_s_b1']:.1f}",
                  f"{r['hf_tok_s_b1']:.1f}", f"{r['ratio_b1']:.2f}x")
    table.add_row(f"{c} concurrent (HF {r['hf_c16_mode']})", f"{r['ours_tok_s_c16']:.1f}",
                  f"{r['hf_tok_s_c16']:.1f}", f"{r['ratio_c16']:.2f}x")
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    console.print(f"batching gain (ours, {c} concurrent / 1 at a time): {r['batching_gain']:.2f}x; "
                  f"HF {c} as one batch {r['hf_tok_s_c16_batched']:.1f} tok/s, one by one "
                  f"{r['hf_tok_s_c16_sequential']:.1f} tok/s")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    p.add_argument("--prompts", default=DEFAULT_QUESTIONS, metavar="FILE.jsonl",
                   help="questions (spec_bench format: a 'turns' list per line)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N",
                   help="prompts run one at a time for batch 1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads, for both engines")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N], for both engines")
    p.add_argument("--hf-sequential-from-b1", action="store_true",
                   help="take HF's one-by-one rate for the concurrent requests from its batch-1 "
                        "run instead of generating them all again one by one")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "triton"],
                   help="ours: EngineConfig.attention_backend")
    p.add_argument("--enforce-eager", action="store_true", help="ours: no CUDA graphs")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_engine_bench(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "max_tokens", "concurrency", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not Path(args.prompts).is_file():
        raise SystemExit(f"--prompts {args.prompts}: no such file")
    questions = load_questions(args.prompts, args.num_prompts + args.concurrency)
    r = run_bench(args.model, questions, args.max_tokens, args.concurrency, args.threads,
                  hf_sequential_c16=not args.hf_sequential_from_b1, device=args.device,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
    return emit(r, args.json, print_results)


def register(subparsers: Any) -> None:
    """Add `engine` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("engine", help="plain decoding tok/s, ours vs HF transformers",
                              description=__doc__.splitlines()[0])
    add_bench_args(p)
    p.set_defaults(func=run_engine_bench)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ngramspec bench engine")
    add_bench_args(p)
    return run_engine_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
