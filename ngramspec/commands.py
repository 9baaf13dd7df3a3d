"""Sub-command wiring and the small interactive commands (generate, chat)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from ngramspec.cli_options import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs_from_args,
    sampling_params_from_args,
)


def register(sub: Any) -> None:
    from ngramspec import cli_drafting as spec_cli
    from ngramspec import demo

    p = sub.add_parser("generate", help="complete one prompt")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user message")
    _add_run_args(p)
    p.set_defaults(func=run_generate)
    p = sub.add_parser("chat", help="interactive chat on stdin")
    _add_run_args(p)
    p.set_defaults(func=run_chat)
    demo.register(sub)
    spec_cli.register(sub)
    if importlib.util.find_spec("ngramspec.server.cli") is not None:
        from ngramspec.server import cli as server_cli

        server_cli.register(sub)


def register_bench(sub: Any) -> None:
    from ngramspec.bench import corpus_bench

    corpus_bench.register_bench(sub)
    for name in ("engine_bench", "speed_bench", "serve_bench", "quality_bench", "context_bench",
                 "llamacpp_bench", "llama_server_bench"):
        if importlib.util.find_spec(f"ngramspec.bench.{name}") is not None:
            importlib.import_module(f"ngramspec.bench.{name}").register(sub)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--stats", action="store_true", help="print speed and speculation statistics")
    p.add_argument("--record-streams", metavar="FILE", default=None,
                   help='append {"id", "prompt_ids", "output_ids"} lines for `ngramspec simulate`')


def _make_llm(args: argparse.Namespace):
    from ngramspec.llm import LLM

    kwargs = engine_kwargs_from_args(args)
    return LLM(record_streams=args.record_streams, **kwargs)


def run_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params_from_args(args)
    prompt: Any = args.prompt
    if args.chat_template:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    out = _complete(llm, prompt, params, args.stream)
    if args.stats:
        _print_stats(llm, out)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params_from_args(args)
    messages: list[dict[str, str]] = []
    print("ngramspec chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        out = _complete(llm, llm.apply_chat_template(messages), params, stream=True)
        messages.append({"role": "assistant", "content": out.text})
        if args.stats:
            _print_stats(llm, out)
    return 0


def _complete(llm, prompt, params, stream: bool):
    from ngramspec.stream import TextStreamer

    streamer = TextStreamer(llm.tokenizer, sys.stdout) if stream else None
    out = llm.generate(prompt, params, on_tokens=streamer.on_tokens if streamer else None)[0]
    if streamer is None:
        print(out.text)
    else:
        streamer.finish(out.text)
    return out


def _print_stats(llm, out) -> None:
    stats = {"request": out.metrics and {k: getattr(out.metrics, k) for k in out.metrics.__slots__},
             "engine": llm.engine.stats.as_dict(), "finish_reason": out.finish_reason}
    print(json.dumps(stats, indent=2), file=sys.stderr)
