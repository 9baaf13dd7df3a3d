"""CLI for the drafting side: `simulate`, `corpus build`, `corpus info`, and the drafter options
every other command reuses (`add_drafter_args` / `drafter_config_from_args`).

Every `DrafterConfig` field is an option `--<field-with-dashes>`; SGLang's spellings
(`--speculative-ngram-max-trie-depth`, `--speculative-num-draft-tokens`, ...) are aliases.
Options left out keep the preset's default (SGLang's for `--preset sglang`).
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.factory import make_drafter

DEST_PREFIX = "drafter_"
# SGLang server flags (docs/reference/sglang_ngram.md §4.1) and their historical names, as aliases.
SGLANG_ALIASES = {
    "draft_token_num": ["--speculative-num-draft-tokens"],
    "max_trie_depth": ["--speculative-ngram-max-trie-depth",
                       "--speculative-ngram-branch-length"],
    "min_bfs_breadth": ["--speculative-ngram-min-bfs-breadth"],
    "max_bfs_breadth": ["--speculative-ngram-max-bfs-breadth"],
    "match_type": ["--speculative-ngram-match-type"],
    "capacity": ["--speculative-ngram-capacity"],
    "external_sam_budget": ["--speculative-ngram-external-sam-budget"],
    "external_corpus_max_tokens": ["--speculative-ngram-external-corpus-max-tokens"],
}


def _arg_type(hint: Any) -> Any:
    """The scalar type argparse should parse for a field hint (`X | None` -> X)."""
    if typing.get_origin(hint) is typing.Literal:
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """Add one option per `DrafterConfig` field (and SGLang's aliases) in a "drafter" group."""
    group = parser.add_argument_group("drafter", "n-gram drafter options (DrafterConfig)")
    hints = typing.get_type_hints(DrafterConfig)
    for f in fields(DrafterConfig):
        kind = _arg_type(hints[f.name])
        choices = list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else None
        names = [f"--{f.name.replace('_', '-')}", *SGLANG_ALIASES.get(f.name, [])]
        kw: dict[str, Any] = {"dest": DEST_PREFIX + f.name, "default": None,
                              "help": f"(default: {f.default})"}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = (str.upper if f.name == "match_type" else str) if choices else kind
            kw["metavar"] = None if choices else f.name.upper()
            kw["choices"] = choices
        group.add_argument(*names, **kw)


def drafter_config_from_args(args: argparse.Namespace) -> DrafterConfig:
    """The config the options ask for; raises ValueError naming a bad field."""
    given = {f.name: getattr(args, DEST_PREFIX + f.name, None) for f in fields(DrafterConfig)}
    given = {k: v for k, v in given.items() if v is not None}
    if given.pop("preset", "ngramspec") == "sglang":
        return DrafterConfig.sglang(**given)
    return DrafterConfig(**given)


# ---- simulate -----------------------------------------------------------------------------------

def add_simulate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="replay recorded greedy streams through a drafter",
                              description="Exact replay of greedy speculative decoding.")
    p.add_argument("--streams", nargs="+", required=True, metavar="FILE.jsonl",
                   help='stream files: lines {"id", "prompt_ids", "output_ids", "category"?}')
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (round-robin)")
    p.add_argument("--corpus", action="append", default=[], metavar="NAME.ngc",
                   help="external corpus built with `corpus build` (repeatable)")
    p.add_argument("--reset-between-files", action="store_true",
                   help="forget online state between stream files")
    p.add_argument("--compare", action="store_true",
                   help="also run SGLang BFS and PROB (and BFS with the prompt inserted)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_drafter_args(p)
    p.set_defaults(func=run_simulate)


def load_corpora(paths: list[str], max_tokens: int) -> Any:
    if not paths:
        return None
    from ngramspec.corpus.registry import ExternalCorpora

    corpora = ExternalCorpora(max_tokens=max_tokens, progress=False)
    for path in paths:
        corpora.add_built(Path(path).stem, path)
    return corpora


def _factories(config: DrafterConfig, corpora: Any, compare: bool) -> dict[str, Any]:
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


def run_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ngramspec.simulator.replay import read_streams, simulate
    from ngramspec.simulator.report import compare, print_report

    config = drafter_config_from_args(args)
    streams = read_streams(args.streams)
    corpora = load_corpora(args.corpus, config.external_corpus_max_tokens)
    factories = _factories(config, corpora, args.compare)
    budget = config.num_draft_tokens
    if args.json:
        reports = {name: simulate(make(), streams, budget, args.concurrency,
                                  args.reset_between_files).to_dict()
                   for name, make in factories.items()}
        json.dump(reports, sys.stdout, indent=1)
        print()
        return 0
    # Wide tables stay readable when piped (rich would wrap them at 80 columns).
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.compare:
        compare(factories, streams, budget, args.concurrency, console, args.reset_between_files)
    else:
        report = simulate(factories[config.preset](), streams, budget, args.concurrency,
                          args.reset_between_files)
        print_report(report, console, title=config.preset)
    return 0


# ---- corpus -------------------------------------------------------------------------------------

def add_corpus_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("corpus", help="build or inspect external corpus files (.ngc)")
    sub = p.add_subparsers(dest="corpus_command", required=True)
    build = sub.add_parser("build", help="tokenise files into a suffix-automaton corpus file")
    build.add_argument("files", nargs="+",
                       help="JSONL (strings or {\"text\"}), text files, directories or globs")
    build.add_argument("-o", "--output", required=True, metavar="NAME.ngc")
    build.add_argument("--model", default=None, help="model whose tokenizer to use")
    build.add_argument("--max-tokens", type=int, default=10_000_000,
                       help="token budget, separators included (default: 10M)")
    build.add_argument("--no-progress", action="store_true")
    build.set_defaults(func=run_corpus_build)
    info = sub.add_parser("info", help="print a corpus file's metadata")
    info.add_argument("path", metavar="NAME.ngc")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=run_corpus_info)


def run_corpus_build(args: argparse.Namespace) -> int:
    import time

    from ngramspec.corpus.registry import build_corpus_file
    from ngramspec.models.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    t0 = time.perf_counter()
    meta = build_corpus_file(args.files, tokenizer, args.output, args.max_tokens,
                             progress=not args.no_progress)
    size = Path(args.output).stat().st_size
    print(f"{args.output}: {meta['num_tokens']} tokens from {len(meta['sources'])} files, "
          f"{size / 1e6:.1f} MB, built in {time.perf_counter() - t0:.1f}s")
    return 0


def run_corpus_info(args: argparse.Namespace) -> int:
    from ngramspec.corpus.registry import corpus_file_info

    info = corpus_file_info(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{args.path}: {info['num_tokens']} tokens, {info['file_bytes'] / 1e6:.2f} MB "
          f"({info['file_bytes'] / max(1, info['num_tokens']):.0f} B/token)")
    print(f"sources ({len(info['sources'])}): {', '.join(info['sources'][:5])}"
          + (" ..." if len(info["sources"]) > 5 else ""))
    for name, a in info["arrays"].items():
        print(f"  {name:<20} {a['dtype']:>5} {str(tuple(a['shape'])):>16} {a['nbytes']:>12} B")
    return 0


def register(subparsers: Any) -> None:
    """Add `simulate` and `corpus` to the main CLI; each sets `func(args) -> int`."""
    add_simulate_parser(subparsers)
    add_corpus_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m ngramspec.cli_drafting ...`) until the main CLI wires `register`."""
    parser = argparse.ArgumentParser(prog="ngramspec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # config validation, corrupt files, bad corpora: one clear line
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
