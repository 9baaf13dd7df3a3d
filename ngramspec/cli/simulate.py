"""`ngramspec simulate`: exact replay of greedy speculative decoding from recorded streams."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ngramspec.cli.drafter_args import add_drafter_args, drafter_config_from_args, load_corpora
from ngramspec.cli.engine_args import positive_floats
from ngramspec.drafting.config import DrafterConfig


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="replay recorded greedy streams through a drafter",
                              description=__doc__)
    p.add_argument("--streams", nargs="+", required=True, metavar="FILE.jsonl",
                   help='stream files: lines {"id", "prompt_ids", "output_ids", "category"?}')
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (round-robin)")
    p.add_argument("--corpus", action="append", default=[], metavar="NAME.ngc",
                   help="external corpus built with `corpus build` (repeatable)")
    p.add_argument("--reset-between-files", action="store_true",
                   help="forget online state between stream files")
    p.add_argument("--compare", action="store_true",
                   help="also run SGLang BFS and PROB (and BFS with the prompt inserted)")
    p.add_argument("--step-ms", type=step_ms_arg, metavar="MS1,MS2,...",
                   help="size trees as the engine would against these step times (milliseconds "
                        "at 1, 2, 4, 8, 12, 16, 24, ... query tokens, e.g. from `ngramspec bench "
                        "context`) and report the modelled speed-up over plain decoding")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables (the tables need ngramspec[bench])")
    add_drafter_args(p)
    p.set_defaults(func=run)


def step_ms_arg(text: str) -> list[float]:
    return positive_floats(text, "--step-ms", "milliseconds, e.g. 5,6,8")


def _factories(config: DrafterConfig, corpora: Any, compare: bool) -> dict[str, Any]:
    from ngramspec.drafting.factory import make_drafter

    factories = {config.preset: lambda: make_drafter(config, corpora)}
    if compare:
        from ngramspec.baselines.sglang.drafter import SGLangDrafter

        d = config.draft_token_num
        bfs = DrafterConfig.sglang(draft_token_num=d)
        prob = DrafterConfig.sglang(draft_token_num=d, match_type="PROB")
        factories["sglang-bfs"] = lambda: make_drafter(bfs, corpora)
        factories["sglang-prob"] = lambda: make_drafter(prob, corpora)
        factories["sglang-bfs+prompt"] = lambda: SGLangDrafter(bfs, corpora, insert_prompt=True)
    return factories


def run(args: argparse.Namespace) -> int:
    from ngramspec.simulator.replay import read_streams, simulate

    config = drafter_config_from_args(args)
    if not args.json:
        from ngramspec.extras import require

        require("bench", "rich")  # before the replay, not after it
    streams = read_streams(args.streams)
    corpora = load_corpora(args.corpus, config.external_corpus_max_tokens)
    factories = _factories(config, corpora, args.compare)
    budget = config.num_draft_tokens
    cost = None
    if args.step_ms is not None:
        from ngramspec.policy.cost import DEFAULT_POINTS, StepCost, VerifyCost

        if len(args.step_ms) > len(DEFAULT_POINTS):
            raise SystemExit(f"--step-ms: at most {len(DEFAULT_POINTS)} times "
                             f"(at {', '.join(map(str, DEFAULT_POINTS))} tokens)")
        cost = StepCost(VerifyCost.from_relative([ms / 1000 for ms in args.step_ms]),
                        learn=False)
    if args.json:
        reports = {name: simulate(make(), streams, budget, args.concurrency,
                                  args.reset_between_files, cost).to_dict()
                   for name, make in factories.items()}
        json.dump(reports, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console

    from ngramspec.simulator.report import compare, print_report

    # Wide tables stay readable when piped (rich would wrap them at 80 columns).
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.compare:
        compare(factories, streams, budget, args.concurrency, console, args.reset_between_files,
                cost)
    else:
        report = simulate(factories[config.preset](), streams, budget, args.concurrency,
                          args.reset_between_files, cost)
        print_report(report, console, title=config.preset)
    return 0
