"""`ngramspec bench corpus`: the CPU cost of drafting on real token streams.

Replays recorded greedy streams (data/streams/*.jsonl) with 1, 16 and 64 requests interleaved and
reports the median µs per request-step of commit + propose (d = 12 unless overridden), plus the
memory of the global trie the replay built. Our drafter queues its commits and runs them inside
the next propose (one call per step), so its work shows in the propose column; prompt insertions
queued at start run there too. Each replay runs `--repeats` times with a fresh
drafter and the fastest run's medians are reported (as timeit does: on a shared machine noise only
ever adds time; the runs' medians on this 2-core VM differ by up to 30%); every run's median is in
the JSON. Memory is in bytes per live node, measured two ways:
- `traced`: tracemalloc's growth over a replay at concurrency 1 after every request stopped, i.e.
  the Python heap the drafter keeps (trie plus whatever it retains), divided by trie nodes;
- `arrays`: the nbytes of the trie's `to_arrays()` per node, i.e. its persisted size.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from typing import Any

from ngramspec.cli.drafter_args import add_drafter_args, drafter_config_from_args, load_corpora
from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.factory import make_drafter
from ngramspec.simulator.replay import Stream, read_streams, replay

DEFAULT_STREAMS = ["data/streams/code_edit.jsonl", "data/streams/spec_bench.jsonl"]
CONCURRENCIES = (1, 16, 64)


def _median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2 if s else 0.0


def step_cost(config: DrafterConfig, streams: list[Stream], concurrency: int,
              repeats: int = 1, corpora: Any = None) -> dict[str, Any]:
    """The fastest of `repeats` replays (by median µs per request-step), with every run's median."""
    runs = [_one_replay(config, streams, concurrency, corpora) for _ in range(repeats)]
    best = dict(min(runs, key=lambda r: r["median_us"]))
    best["run_medians_us"] = [r["median_us"] for r in runs]
    return best


def _one_replay(config: DrafterConfig, streams: list[Stream], concurrency: int,
                corpora: Any = None) -> dict[str, Any]:
    drafter = make_drafter(config, corpora)
    t0 = time.perf_counter()
    results = replay(drafter, streams, config.num_draft_tokens, concurrency)
    wall = time.perf_counter() - t0
    per_step = [p + c for r in results for p, c in zip(r.propose_us, r.commit_us)]
    steps = sum(r.steps for r in results)
    return {
        "concurrency": concurrency, "steps": steps,
        "mean_accepted": sum(r.tokens for r in results) / max(1, steps),
        "median_us": _median(per_step),
        "propose_us": _median([u for r in results for u in r.propose_us]),
        "commit_us": _median([u for r in results for u in r.commit_us]),
        "p90_us": sorted(per_step)[int(0.9 * (len(per_step) - 1))] if per_step else 0.0,
        "wall_s": wall,
    }


def find_trie(drafter: Any) -> Any:
    """The drafter's global trie (ours: `.trie`; the SGLang preset: `.corpus.trie`)."""
    for path in ("trie", "corpus.trie", "_trie", "index.trie"):
        obj = drafter
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if obj is not None and hasattr(obj, "num_nodes"):
            return obj
    return None


def trie_memory(config: DrafterConfig, streams: list[Stream],
                corpora: Any = None) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        # Built before the baseline: its corpus tables are the corpora's memory, not the trie's.
        drafter = make_drafter(config, corpora)
        before = tracemalloc.get_traced_memory()[0]
        replay(drafter, streams, config.num_draft_tokens, 1)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    trie = find_trie(drafter)
    if trie is None:
        return {"nodes": None, "traced_bytes": traced}
    nodes = int(trie.num_nodes() if callable(trie.num_nodes) else trie.num_nodes)
    out: dict[str, Any] = {"nodes": nodes, "traced_bytes": traced,
                           "traced_bytes_per_node": traced / max(1, nodes)}
    if hasattr(trie, "to_arrays"):
        _, arrays = trie.to_arrays()
        out["array_bytes_per_node"] = sum(a.nbytes for a in arrays.values()) / max(1, nodes)
    return out


def run_bench(configs: dict[str, DrafterConfig], streams: list[Stream],
              concurrencies: tuple[int, ...] = CONCURRENCIES, repeats: int = 3,
              corpora: Any = None) -> dict[str, Any]:
    """`corpora`: external corpora every drafter reads (an ExternalCorpora), or None."""
    warm = make_drafter(next(iter(configs.values())), corpora)
    replay(warm, streams[:2], 11, 1)  # warm-up (JIT, caches)
    out: dict[str, Any] = {}
    for name, config in configs.items():
        out[name] = {"steps": [step_cost(config, streams, c, repeats, corpora)
                               for c in concurrencies],
                     "memory": trie_memory(config, streams, corpora)}
    return out


def print_results(results: dict[str, Any], num_streams: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"drafting cost per request-step (commit + propose), {num_streams} streams; "
                        "fastest run's medians, and every run's median")
    for col in ("drafter", "in flight", "steps", "mean acc", "median µs", "propose µs",
                "commit µs", "p90 µs", "runs' medians", "trie nodes", "B/node traced",
                "B/node arrays"):
        table.add_column(col, justify="left" if col == "drafter" else "right")
    for name, r in results.items():
        mem = r["memory"]
        for i, s in enumerate(r["steps"]):
            extra = ([_num(mem.get("nodes")), _num(mem.get("traced_bytes_per_node")),
                      _num(mem.get("array_bytes_per_node"))] if i == 0 else ["", "", ""])
            table.add_row(name if i == 0 else "", str(s["concurrency"]), str(s["steps"]),
                          f"{s['mean_accepted']:.2f}", f"{s['median_us']:.1f}",
                          f"{s['propose_us']:.1f}", f"{s['commit_us']:.1f}",
                          f"{s['p90_us']:.1f}",
                          " ".join(f"{m:.1f}" for m in s.get("run_medians_us", [])), *extra)
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", nargs="+", default=DEFAULT_STREAMS, metavar="FILE.jsonl")
    p.add_argument("--presets", nargs="+", default=["ngramspec", "sglang"],
                   choices=["ngramspec", "sglang"],
                   help="drafters to measure (other drafter options apply to each)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    p.add_argument("--repeats", type=int, default=3,
                   help="replays per concurrency; the fastest run's medians are reported")
    p.add_argument("--corpus", action="append", default=[], metavar="NAME.ngc",
                   help="external corpus built with `corpus build` (repeatable), read by every "
                        "drafter")
    p.add_argument("--json", action="store_true")
    add_drafter_args(p)


def run(args: argparse.Namespace) -> int:
    streams = read_streams(args.streams)
    configs = {}
    for preset in args.presets:
        args.drafter_preset = preset
        configs[preset] = drafter_config_from_args(args)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    corpora = load_corpora(args.corpus, configs[args.presets[0]].external_corpus_max_tokens)
    results = run_bench(configs, streams, tuple(args.concurrency), args.repeats, corpora)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_results(results, len(streams))
    return 0


def register_bench(subparsers: Any) -> None:
    """Add `corpus` under the main CLI's `bench` subcommands."""
    p = subparsers.add_parser("corpus", help="drafting cost per request-step on real streams",
                              description=__doc__.splitlines()[0])
    add_bench_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ngramspec bench corpus")
    add_bench_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
