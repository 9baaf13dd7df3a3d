"""`ngramspec generate PROMPT`: complete one prompt and print it."""

from __future__ import annotations

import argparse
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
    p = sub.add_parser("generate", help="complete one prompt", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="send the prompt as a user message through the chat template")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help=CHAT_TEMPLATE_HELP + "; implies --apply-chat-template")
    add_run_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = sampling_params_from_args(args)
    prompt: Any = args.prompt
    if args.apply_chat_template or args.chat_template is not None:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = complete(llm, prompt, params, args.stream)
    if args.stats:
        print_stats(llm, out)
    return 0
