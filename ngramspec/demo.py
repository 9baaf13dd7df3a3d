"""`ngramspec demo`: answer a few bundled prompts on the default model, streaming, then compare
the speed with and without n-gram speculation."""

from __future__ import annotations

import argparse
import inspect
import io
import sys
from typing import Any

_SUMMARY_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
    "of Queensland, Australia. The Great Barrier Reef can be seen from outer space and is the "
    "world's biggest single structure made by living organisms. This reef structure is composed "
    "of and built by billions of tiny organisms, known as coral polyps."
)


def demo_prompts() -> list[tuple[str, str]]:
    import textwrap

    source = textwrap.dedent(inspect.getsource(textwrap.indent))
    return [
        ("code edit", ("Rewrite this Python function, renaming the parameter `prefix` to `pad` "
                      f"everywhere. Reply with the whole function only.\n\n```python\n{source}```")),
        ("summary", f"Repeat the key facts of this text as a bulleted list:\n\n{_SUMMARY_TEXT}"),
        ("question", "Explain in three sentences why the sky is blue."),
    ]


def register(sub: Any) -> None:
    from ngramspec.cli_options import add_engine_args

    p = sub.add_parser("demo", help="stream a few answers, then compare speed with/without speculation")
    p.add_argument("--max-tokens", type=int, default=300)
    add_engine_args(p)
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ngramspec.cli_options import engine_kwargs_from_args
    from ngramspec.llm import LLM
    from ngramspec.sampling_params import SamplingParams
    from ngramspec.stream import TextStreamer

    kwargs = engine_kwargs_from_args(args)
    kwargs["speculative"] = "ngram"
    console = Console(stderr=True)
    console.print("[bold]loading the model…[/bold]")
    llm = LLM(**kwargs)
    table = Table(title="speed: plain decoding vs n-gram speculation (greedy, same engine)")
    for col in ("prompt", "tokens", "plain decode tok/s", "spec decode tok/s", "speedup", "accepted/step", "same output"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    for name, prompt in demo_prompts():
        ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
        console.rule(f"[bold]{name}")
        print(prompt[:200] + ("…" if len(prompt) > 200 else ""), end="\n\n")
        # Speculation runs first: the n-gram trie learns every answer, so a second run of the same
        # prompt would copy the first. Both stream (plain into a buffer) and both are timed after
        # their first token, so the plain run's prompt, found in the prefix cache, does not count.
        spec_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        streamer = TextStreamer(llm.tokenizer, sys.stdout)
        spec = llm.generate(ids, spec_params, on_tokens=streamer.on_tokens)[0]
        streamer.finish(spec.text)
        plain_params = SamplingParams(temperature=0, max_tokens=args.max_tokens, speculative=False)
        plain = llm.generate(ids, plain_params,
                             on_tokens=TextStreamer(llm.tokenizer, io.StringIO()).on_tokens)[0]
        plain_rate, spec_rate = plain.metrics.decode_tok_s, spec.metrics.decode_tok_s
        table.add_row(name, str(len(spec.token_ids)), f"{plain_rate:.1f}", f"{spec_rate:.1f}",
                      f"{spec_rate / plain_rate:.2f}x", f"{spec.metrics.mean_acceptance_length:.2f}",
                      "yes" if plain.token_ids == spec.token_ids else "NO")
    Console().print(table)
    return 0
