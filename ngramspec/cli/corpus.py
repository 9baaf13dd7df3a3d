"""`ngramspec corpus build | info`: external corpus files (.ngc) for the drafter."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("corpus", help="build or inspect external corpus files (.ngc)",
                              description=__doc__)
    sub = p.add_subparsers(dest="corpus_command", required=True)
    build = sub.add_parser("build", help="tokenise files into a suffix-automaton corpus file")
    build.add_argument("files", nargs="+",
                       help="JSONL (strings or {\"text\"}), text files, directories or globs")
    build.add_argument("-o", "--output", required=True, metavar="NAME.ngc")
    build.add_argument("--model", default=None,
                       help="model whose tokenizer to use (path or cached HF id; default: "
                            "SmolLM2-135M)")
    build.add_argument("--max-tokens", type=int, default=10_000_000,
                       help="token budget, separators included (default: 10M)")
    build.add_argument("--no-progress", action="store_true")
    build.set_defaults(func=run_build)
    info = sub.add_parser("info", help="print a corpus file's metadata")
    info.add_argument("path", metavar="NAME.ngc")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=run_info)


def run_build(args: argparse.Namespace) -> int:
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


def run_info(args: argparse.Namespace) -> int:
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
        print(f"  {name:<20} {a['dtype']:>5} {tuple(a['shape'])!s:>16} {a['nbytes']:>12} B")
    return 0
