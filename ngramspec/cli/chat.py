"""`ngramspec chat`: an interactive chat on stdin, one user message a line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ngramspec.cli.completion import (
    CHAT_TEMPLATE_HELP,
    add_run_args,
    complete,
    make_llm,
    print_stats,
)
from ngramspec.cli.engine_args import sampling_params_from_args


def register(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat on stdin", description=__doc__)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT", help=CHAT_TEMPLATE_HELP)
    add_run_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = sampling_params_from_args(args)
    messages: list[dict[str, str]] = []
    print("ngramspec chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        out = complete(llm, llm.apply_chat_template(messages), params, stream=True)
        messages.append({"role": "assistant", "content": out.text})
        if args.stats:
            print_stats(llm, out)
    return 0
