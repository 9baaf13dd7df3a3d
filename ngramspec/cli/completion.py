"""What `generate` and `chat` share: their options, the LLM they build, printing a completion."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ngramspec.cli.engine_args import add_engine_args, add_sampling_args, engine_kwargs_from_args

CHAT_TEMPLATE_HELP = ("a Jinja chat template replacing the model's: a file path or the template "
                      "text (vLLM's --chat-template)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--stats", action="store_true", help="print speed and speculation statistics")
    p.add_argument("--record-streams", metavar="FILE", default=None,
                   help='append {"id", "prompt_ids", "output_ids"} lines for `ngramspec simulate`')


def make_llm(args: argparse.Namespace) -> Any:
    from ngramspec.llm import LLM

    return LLM(record_streams=args.record_streams, chat_template=args.chat_template,
               **engine_kwargs_from_args(args))


def complete(llm: Any, prompt: Any, params: Any, stream: bool) -> Any:
    """Generate one completion, printing it (as it comes with `stream`); the RequestOutput."""
    from ngramspec.stream import TextStreamer

    streamer = TextStreamer(llm.tokenizer, sys.stdout) if stream else None
    out = llm.generate(prompt, params, on_tokens=streamer.on_tokens if streamer else None)[0]
    if streamer is None:
        print(out.text)
    else:
        streamer.finish(out.text)
    return out


def print_stats(llm: Any, out: Any) -> None:
    stats = {"request": out.metrics and {k: getattr(out.metrics, k) for k in out.metrics.__slots__},
             "engine": llm.engine.stats.as_dict(), "finish_reason": out.finish_reason}
    print(json.dumps(stats, indent=2), file=sys.stderr)
