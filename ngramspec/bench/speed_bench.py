"""`ngramspec bench speed`: the headline benchmark of n-gram speculative decoding.

On the same prompts in one run it times (a) our plain decoding, (b) our n-gram speculation with
the given drafter options, (c) our faithful SGLang preset and (d) Hugging Face's prompt-lookup
decoding (`generate(prompt_lookup_num_tokens=10)`, batch 1 only). All greedy, chat template on.

Fairness: the drafter learns across requests, so each configuration gets its own LLM instance
(no state leaks between them) and one short warm-up request first (compilation, allocator,
caches). tok/s = generated tokens / wall time of that configuration over a category's prompts.
All engines run in lockstep: one engine step each in turn, rotating who goes first, and only
the steps are timed. A machine that speeds up or slows down during the run (this one drifts by
10-20% between runs of the same prompt) therefore biases no configuration. At --concurrency 1
prompts run one at a time, so each category has exact times; at --concurrency N all prompts are
submitted at once with max_num_seqs=N and only overall tok/s is exact (per category: mean
accepted length only).
Greedy speculation must reproduce plain decoding token for token: mismatches are counted, never hidden.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ngramspec.bench.workloads import WORKLOADS, BenchPrompt, build_workload

DEFAULT_MAX_TOKENS = 256
HF_LOOKUP_TOKENS = 10
WARMUP_PROMPT = "Say hello."


@dataclass(slots=True)
class ConfigRun:
    """One configuration over the workload: outputs in prompt order and how long they took."""

    name: str
    token_ids: list[list[int]]
    seconds: list[float] | None  # per prompt (concurrency 1); None when run concurrently
    wall: float
    accepted: list[tuple[float, int]] = field(default_factory=list)  # (emitted, verify steps)
    engine_stats: dict[str, float] = field(default_factory=dict)


def register(sub: Any) -> None:
    from ngramspec.cli.engine_args import add_engine_args

    p = sub.add_parser("speed", help="plain vs n-gram speculation vs SGLang preset vs HF PLD",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight (sets max_num_seqs; --max-num-seqs is ignored)")
    p.add_argument("--limit", type=int, default=None, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"per request (default: the workload's, else {DEFAULT_MAX_TOKENS})")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="speedup bars per category")
    p.add_argument("--spec-bench-path", default=None, help="Spec-Bench question.jsonl")
    p.add_argument("--skip-hf", action="store_true", help="leave out HF prompt-lookup decoding")
    p.add_argument("--hf-plain", action="store_true", help="also time HF greedy without PLD")
    p.add_argument("--skip-verify-cost", action="store_true", help="leave out the cost curve")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise ValueError(f"--concurrency={args.concurrency} must be >= 1")
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError("bench speed runs three engines side by side in one process; tensor "
                         "parallelism allows one per process (--tensor-parallel-size 1)")
    prompts = build_workload(args.workload, args.limit, args.spec_bench_path)
    if not prompts:
        raise ValueError(f"workload {args.workload!r} has no prompts")
    runs, extra = run_all(args, prompts)
    report = build_report(args, prompts, runs, extra)
    print_table(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
    if args.plot:
        plot_speedups(report, args.plot)
    return 0


# ---- running the configurations ---------------------------------------------------------------

def run_all(args: argparse.Namespace, prompts: list[BenchPrompt]) -> tuple[dict[str, ConfigRun], dict]:
    from ngramspec.cli.engine_args import engine_kwargs_from_args
    from ngramspec.drafting.config import DrafterConfig

    base = engine_kwargs_from_args(args)
    base["max_num_seqs"] = args.concurrency
    ours = base["drafter"]
    configs = {"plain": dict(base, speculative=None),
               "spec": dict(base, speculative="ngram", drafter=ours),
               "sglang": dict(base, speculative="ngram", drafter=DrafterConfig.sglang())}
    runs: dict[str, ConfigRun] = {}
    extra: dict[str, Any] = {"drafter": _as_dict(ours),
                             "sglang_drafter": _as_dict(configs["sglang"]["drafter"]), "notes": []}
    ids: list[list[int]] = []
    max_tokens = [args.max_tokens or p.max_tokens or DEFAULT_MAX_TOKENS for p in prompts]
    llms = {name: _make_llm(kwargs) for name, kwargs in configs.items()}
    ids = [llms["plain"].apply_chat_template(p.messages()) for p in prompts]
    grammars = [p.structured for p in prompts]
    extra.update(_engine_info(llms["plain"]))
    if not args.skip_verify_cost:
        extra["verify_cost"] = _verify_cost(llms["plain"])
    runs.update(run_lockstep(llms, ids, max_tokens, args.concurrency, grammars))
    extra["divergence_gaps"] = {name: divergence_gaps(llms["plain"], ids, runs["plain"].token_ids,
                                                      runs[name].token_ids)
                                for name in runs if name != "plain"}
    del llms
    gc.collect()
    if args.skip_hf:
        extra["notes"].append("HF prompt-lookup decoding skipped (--skip-hf)")
    elif any(grammars):
        extra["notes"].append("HF prompt-lookup decoding has no grammar support: skipped")
    elif args.concurrency > 1:
        extra["notes"].append("HF prompt-lookup decoding runs at batch 1 only: skipped")
    else:
        runs.update(run_hf(args.model, ids, max_tokens, extra, args.hf_plain))
    return runs, extra


def divergence_gaps(plain_llm, ids: list[list[int]], plain: list[list[int]],
                    other: list[list[int]]) -> list[float]:
    """For each request whose output differs from plain decoding: the plain model's logit gap
    between its top two tokens where they part. Exact modes never differ; in bf16 a tree verify
    and a single decode round differently, so only near-ties (gaps of a bf16 rounding) may flip.
    The gap comes from one prefill forward over the prompt and plain's tokens up to there, which
    rounds like neither step (and sees no grammar mask): a close estimate, not the logits
    either run sampled from."""
    from ngramspec.engine.step_inputs import ForwardItem

    engine, gaps = plain_llm.engine, []
    for prompt, a, b in zip(ids, plain, other):
        if a == b:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        tokens = prompt + a[:at]
        n = len(tokens)
        with engine.scheduler.scratch_slots(n) as slots:
            item = ForwardItem(tokens, list(range(n)), [], slots, None, [n - 1])
            top = engine.runner.run([item])[0].float().topk(2).values
        gaps.append(round(float(top[0] - top[1]), 4))
    return gaps


def _make_llm(kwargs: dict[str, Any]):
    from ngramspec.llm import LLM
    from ngramspec.sampling_params import SamplingParams

    llm = LLM(**kwargs)
    warm = llm.apply_chat_template([{"role": "user", "content": WARMUP_PROMPT}])
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8))
    llm.engine.stats = type(llm.engine.stats)()  # the warm-up is not part of the measurement
    return llm


def run_lockstep(llms: dict[str, Any], ids: list[list[int]], max_tokens: list[int],
                 concurrency: int, grammars: list | None = None) -> dict[str, ConfigRun]:
    """Run the same requests on every engine, one engine step each in turn (rotating who goes
    first), timing each engine's steps only. At concurrency 1 the prompts go one at a time
    (timed per prompt); otherwise all at once with max_num_seqs = concurrency."""
    from tqdm import tqdm

    from ngramspec.outputs import build_output
    from ngramspec.sampling_params import SamplingParams

    names = list(llms)
    outputs: dict[str, dict[int, Any]] = {n: {} for n in names}
    seconds: dict[str, list[float]] = {n: [0.0] * len(ids) for n in names}
    wall = dict.fromkeys(names, 0.0)
    batches = [[i] for i in range(len(ids))] if concurrency == 1 else [list(range(len(ids)))]
    bar = tqdm(total=len(ids) * len(names), desc="requests (all engines)", file=sys.stderr)
    for batch in batches:
        index: dict[tuple[str, str], int] = {}
        for name in names:
            for i in batch:
                p = SamplingParams(temperature=0, max_tokens=max_tokens[i],
                                   structured_outputs=grammars[i] if grammars else None)
                index[name, llms[name].add_request(ids[i], p)] = i
        active, turn = list(names), 0
        while active:
            for name in active[turn % len(active):] + active[:turn % len(active)]:
                engine = llms[name].engine
                t0 = time.perf_counter()
                step = engine.step()
                dt = time.perf_counter() - t0
                wall[name] += dt
                for i in batch:
                    seconds[name][i] += dt / len(batch)
                for out in step:
                    if out.seq.is_finished:
                        outputs[name][index[name, out.seq.request_id]] = build_output(
                            out.seq, engine.tokenizer)
                        bar.update(1)
            turn += 1
            active = [n for n in active if llms[n].engine.has_unfinished()]
    bar.close()
    timed = concurrency == 1
    return {n: _config_run(n, [outputs[n][i] for i in range(len(ids))],
                           seconds[n] if timed else None, wall[n], llms[n]) for n in names}


def _config_run(name: str, outputs: list, seconds: list[float] | None, wall: float,
                llm) -> ConfigRun:
    accepted = [(o.metrics.mean_acceptance_length * o.metrics.num_verify_steps,
                 o.metrics.num_verify_steps) if o.metrics else (0.0, 0) for o in outputs]
    return ConfigRun(name, [o.token_ids for o in outputs], seconds, wall, accepted,
                     llm.engine.stats.as_dict())


def run_hf(model: str | None, ids: list[list[int]], max_tokens: list[int], info: dict,
           with_plain: bool) -> dict[str, ConfigRun]:
    """HF transformers on the same token ids, same dtype/device/threads as our engine."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from ngramspec.models.loader import resolve_model_dir

    device, dtype = torch.device(info["device"]), getattr(torch, info["dtype"])
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dtype).to(device).eval()
    eos = info["eos_token_ids"]
    modes = {"hf_pld": {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}}
    if with_plain:
        modes = {"hf_plain": {}, **modes}
    runs = {}
    for name, mode in modes.items():
        hf.generate(torch.tensor([ids[0]], device=device), max_new_tokens=4, do_sample=False,
                    eos_token_id=eos, pad_token_id=eos[0], **mode)  # warm-up
        tokens, seconds = [], []
        for prompt, m in zip(tqdm(ids, desc=name, file=sys.stderr), max_tokens):
            x = torch.tensor([prompt], device=device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **mode)
            seconds.append(time.perf_counter() - t0)
            tokens.append(out[0, len(prompt):].tolist())
        runs[name] = ConfigRun(name, tokens, seconds, sum(seconds))
    return runs


def _engine_info(llm) -> dict[str, Any]:
    import torch

    cfg = llm.config
    return {"model": cfg.model or "SmolLM2-135M-Instruct (default)",
            "device": str(cfg.torch_device), "dtype": str(cfg.torch_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "eos_token_ids": list(llm.engine.eos_token_ids)}


def _verify_cost(llm) -> dict:
    from ngramspec.engine.cost_model import measure_verify_cost

    return measure_verify_cost(llm, batch_sizes=(1, 16), num_tokens=(1, 2, 4, 8, 16, 32))


def _as_dict(config: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


# ---- the report -------------------------------------------------------------------------------

def summarize(runs: dict[str, ConfigRun], idx: list[int], timed: bool) -> dict[str, Any]:
    """Numbers for the prompts `idx` (a category or all); tok/s only where times are per prompt."""
    plain = runs["plain"]
    row: dict[str, Any] = {"prompts": len(idx), "tokens": sum(len(plain.token_ids[i]) for i in idx)}
    for name, r in runs.items():
        tokens = sum(len(r.token_ids[i]) for i in idx)
        if timed:
            secs = r.wall if r.seconds is None else sum(r.seconds[i] for i in idx)
            row[f"{name}_tok_s"] = tokens / secs if secs > 0 else None
        if r.accepted:
            emitted, steps = (sum(r.accepted[i][k] for i in idx) for k in (0, 1))
            row[f"{name}_mean_accepted"] = emitted / steps if steps else None
        if name != "plain":
            row[f"{name}_mismatches"] = sum(r.token_ids[i] != plain.token_ids[i] for i in idx)
    for name in runs:
        if name != "plain" and row.get(f"{name}_tok_s") and row.get("plain_tok_s"):
            row[f"{name}_speedup"] = row[f"{name}_tok_s"] / row["plain_tok_s"]
    if row.get("hf_pld_tok_s") and row.get("hf_plain_tok_s"):
        row["hf_pld_own_speedup"] = row["hf_pld_tok_s"] / row["hf_plain_tok_s"]
    row["mean_accepted"] = row.pop("spec_mean_accepted", None)
    row["speedup"] = row.pop("spec_speedup", None)
    row.pop("plain_mean_accepted", None)
    first = [k for k, _, _ in COLUMNS if k in row]
    return {k: row[k] for k in first + sorted(set(row) - set(first))}


def build_report(args: argparse.Namespace, prompts: list[BenchPrompt],
                 runs: dict[str, ConfigRun], extra: dict) -> dict[str, Any]:
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    timed = args.concurrency == 1
    categories = {cat: summarize(runs, idx, timed) for cat, idx in by_cat.items()}
    overall = summarize(runs, list(range(len(prompts))), True)
    notes = list(extra.pop("notes"))
    if not timed:
        notes.append(f"concurrency {args.concurrency}: tok/s and speedups are overall only; "
                     "categories report mean accepted length and mismatches")
    notes.append("speedups are relative to our plain decoding (hf_pld_speedup included); "
                 "hf_pld_mismatches differ from ours by numerics, not a correctness check")
    masks = {n: r.engine_stats["grammar_mask_us_per_node"] for n, r in runs.items()
             if r.engine_stats.get("grammar_mask_us_per_node")}
    if masks:
        notes.append("grammar mask cost per tree node (compute + apply): " + ", ".join(
            f"{n} {us:.1f} us" for n, us in masks.items()))
    mismatches = {n: overall[f"{n}_mismatches"] for n in runs if n != "plain"}
    for name, gaps in extra.get("divergence_gaps", {}).items():
        if gaps:
            notes.append(f"{name} != plain at {len(gaps)} requests; plain's top-2 logit gap where "
                         f"they part: largest {max(gaps):.3f}, median {sorted(gaps)[len(gaps) // 2]:.3f}")
    return {"workload": args.workload, "concurrency": args.concurrency, "limit": args.limit,
            "max_tokens": args.max_tokens, "categories": categories, "overall": overall,
            "verify_cost": extra.pop("verify_cost", None), "mismatches": mismatches,
            "engine_stats": {n: r.engine_stats for n, r in runs.items() if r.engine_stats},
            **extra, "notes": notes}


COLUMNS = [("prompts", "n", "d"), ("tokens", "tokens", "d"), ("plain_tok_s", "plain tok/s", ".1f"),
           ("spec_tok_s", "spec tok/s", ".1f"), ("speedup", "speedup", ".2f"),
           ("mean_accepted", "accepted", ".2f"), ("sglang_tok_s", "sglang tok/s", ".1f"),
           ("sglang_speedup", "sglang speedup", ".2f"), ("sglang_mean_accepted", "sglang acc", ".2f"),
           ("hf_pld_tok_s", "HF PLD tok/s", ".1f"), ("hf_pld_speedup", "HF PLD speedup", ".2f"),
           ("hf_plain_tok_s", "HF plain tok/s", ".1f"),
           ("hf_pld_own_speedup", "HF PLD/HF plain", ".2f"),
           ("spec_mismatches", "spec ≠", "d"), ("sglang_mismatches", "sglang ≠", "d")]


def print_table(report: dict[str, Any], file) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"bench speed: {report['workload']}, concurrency {report['concurrency']} "
             f"({report.get('device')}, {report.get('dtype')}, {report.get('threads')} threads)")
    table = Table(title=title)
    shown = [c for c in COLUMNS if c[0] in report["overall"]]
    table.add_column("category")
    for _, header, _ in shown:
        table.add_column(header, justify="right")
    rows = [*report["categories"].items(), ("overall", report["overall"])]
    for i, (cat, row) in enumerate(rows):
        cells = [_fmt(row.get(key), fmt, "speedup" in key) for key, _, fmt in shown]
        table.add_row(cat, *cells, end_section=i == len(rows) - 2)
    console = Console(file=file, width=220)
    console.print(table)
    for note in report["notes"]:
        console.print(f"note: {note}")


def _fmt(value: Any, fmt: str, times: bool) -> str:
    if value is None:
        return "-"
    return format(value, fmt) + ("x" if times else "")


def plot_speedups(report: dict[str, Any], path: str) -> None:
    """Left: speedup over our plain decoding (per category where timed); right: mean accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {**report["categories"], "overall": report["overall"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 1.4 * len(rows)), 4.5))
    speed = {k: r for k, r in rows.items() if r.get("speedup") is not None}
    _bars(left, speed, [("speedup", "ngramspec"), ("sglang_speedup", "SGLang preset"),
                        ("hf_pld_speedup", "HF prompt lookup")])
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("speedup over our plain decoding")
    _bars(right, rows, [("mean_accepted", "ngramspec"), ("sglang_mean_accepted", "SGLang preset")])
    right.set_ylabel("tokens per verify step")
    fig.suptitle(f"{report['workload']} (concurrency {report['concurrency']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(ax, rows: dict[str, dict], series: list[tuple[str, str]]) -> None:
    series = [s for s in series if any(r.get(s[0]) is not None for r in rows.values())]
    width = 0.8 / max(1, len(series))
    for k, (key, label) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0.0 for r in rows.values()], width, label=label)
    ax.set_xticks(range(len(rows)), list(rows), rotation=30, ha="right")
    if series:
        ax.legend()
