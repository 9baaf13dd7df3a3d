"""The `ngramspec` command line: one parser, a module per sub-command.

    generate  complete one prompt             chat      interactive chat on stdin
    demo      streamed answers, then speed    serve     the OpenAI-compatible server
    simulate  replay streams through drafters corpus    build or inspect corpus files
    bench     the benchmarks                  build     compile the native code now

Shared options live in engine_args (engine, sampling, vLLM's --speculative-config) and
drafter_args (every DrafterConfig field).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ngramspec.extras import MissingExtraError, require

# Sub-command modules in help order; each has `register(subparsers)`, which sets `func(args)`.
COMMANDS = ("generate", "chat", "demo", "serve", "simulate", "corpus", "bench", "build")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ngramspec", description="An LLM inference engine with lossless n-gram speculative "
        "decoding: offline generation, an OpenAI-compatible server, benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"ngramspec.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for extra, modules in getattr(args, "requires", ()):
            require(extra, *modules)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, MissingExtraError) as e:
        parser.exit(2, f"ngramspec {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
