"""`ngramspec demo`: answer a few bundled prompts on the default model, streaming, then compare
the speed with and without n-gram speculation. Needs nothing beyond `pip install ngramspec`."""

from __future__ import annotations

import argparse
import inspect
import io
import sys
from typing import Any

from ngramspec.cli.engine_args import add_engine_args, engine_kwargs_from_args

_SUMMARY_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
    "of Queensland, Australia. The Great Barrier Reef can be seen from outer space and is the "
    "world's biggest single structure made by living organisms. This reef structure is composed "
    "of and built by billions of tiny organisms, known as coral polyps."
)
COLUMNS = ("prompt", "tokens", "plain decode tok/s", "spec decode tok/s", "speedup",
           "accepted/step", "same output")


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
    p = sub.add_parser("demo", help="stream a few answers, then compare speed with/without "
                                    "speculation", description=__doc__)
    p.add_argument("--max-tokens", type=int, default=300)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ngramspec.llm import LLM
    from ngramspec.sampling_params import SamplingParams
    from ngramspec.stream import TextStreamer

    kwargs = engine_kwargs_from_args(args)
    kwargs["speculative"] = "ngram"
    print("loading the model…", file=sys.stderr)
    llm = LLM(**kwargs)
    rows = []
    for name, prompt in demo_prompts():
        ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
        print(f"\n──── {name} " + "─" * max(0, 60 - len(name)))
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
        rows.append([name, str(len(spec.token_ids)), f"{plain_rate:.1f}", f"{spec_rate:.1f}",
                     f"{spec_rate / plain_rate:.2f}x", f"{spec.metrics.mean_acceptance_length:.2f}",
                     "yes" if plain.token_ids == spec.token_ids else "NO"])
    print("\nspeed: plain decoding vs n-gram speculation (greedy, same engine)")
    print(format_table(COLUMNS, rows))
    return 0


def format_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    """Plain aligned columns: the first left-aligned, the numbers right-aligned."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(cells: Any) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(columns), line("-" * w for w in widths), *map(line, rows)])
