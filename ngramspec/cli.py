"""`ngramspec` command line: generate, chat, demo, serve, bench, simulate, corpus."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from ngramspec import commands

    parser = argparse.ArgumentParser(prog="ngramspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands.register(sub)
    bench = sub.add_parser("bench", help="benchmarks: engine | speed | corpus | serve")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    commands.register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"ngramspec {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
