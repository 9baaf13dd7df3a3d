"""`ngramspec bench serve`: load test of a live server over loopback, speculation on and off.

    ngramspec serve --speculative ngram &
    ngramspec bench serve --concurrency 8 [--json]

Every prompt of a fixed set is sent as a streaming greedy chat completion, `--concurrency` at a
time, once with speculation on and once off (the per-request `"ngram": {"enabled": ...}` switch,
so both runs hit the same server). Reports requests/s, output tokens/s, TTFT p50/p99 and ITL
p50/p99 (ITL = gap between streamed chunks after the first; a speculative burst is one chunk).

`--multi-turn`: `--concurrency` conversations of `--turns` turns on one long system prompt, each
turn resending the whole conversation; adds TTFT p50 by turn (run it against a server started
with and one without `--no-prefix-cache`).

`--structured`: the prompts are JSON extractions over 12 schemas (`response_format`
json_schema), with every tenth request a `guided_regex` and every tenth a `guided_choice`; each
output is checked (JSON parsed and validated with `jsonschema`, regex fully matched, choice one
of the options) and the failures are counted as `invalid`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

_CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
PROMPTS = [
    f"Add type hints to every function in this code and return the full code:\n{_CODE}",
    f"Rename `values` to `xs` everywhere in this code and return the full code:\n{_CODE}",
    "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, "
    "fig, grape, honeydew, kiwi, lemon, mango, nectarine.",
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence and then list three facts about it.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "Give me five tips for writing clean Python code.",
]


@dataclass(slots=True)
class RequestResult:
    ttft: float
    e2e: float
    gaps: list[float]
    output_tokens: int
    acceptance_length: float
    text: str = ""


@dataclass(slots=True)
class Report:
    mode: str
    num_requests: int
    concurrency: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    mean_acceptance_length: float
    errors: int = 0
    invalid: int = 0  # --structured: outputs that do not match what was asked
    extra: dict[str, Any] = field(default_factory=dict)


async def _one(client: Any, url: str, headers: dict[str, str], body: dict[str, Any]
               ) -> RequestResult:
    start = time.perf_counter()
    first, last, gaps, usage, spec, text = None, None, [], {}, {}, []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            spec = chunk.get("speculation") or spec
            pieces = [c.get("delta", {}).get("content") for c in chunk.get("choices", [])]
            if not any(pieces):
                continue
            text += [p for p in pieces if p]
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    return RequestResult((first or end) - start, end - start, gaps,
                         usage.get("completion_tokens", 0),
                         spec.get("mean_acceptance_length", 0.0), "".join(text))


MULTI_TURN_SYSTEM = (
    "You are the support assistant of Northwind Outfitters, an online shop for hiking and camping "
    "gear. Policies: orders ship within two business days from the Leeds warehouse; returns are "
    "accepted within 30 days if the item is unused and in its original packaging; refunds go to "
    "the original payment method within five business days of the return arriving; tents and "
    "sleeping bags carry a two-year warranty, boots one year; express shipping costs 9.50 and "
    "arrives the next business day if ordered before 2 pm; we do not ship to PO boxes. Answer in "
    "at most three sentences, quote order numbers exactly, and say when you do not know.")
MULTI_TURN_QUESTIONS = [
    "My order {n} has not shipped yet. When will it?", "Can I switch it to express shipping?",
    "What if the boots do not fit?", "How long does the refund take?",
    "Is the tent covered if a pole breaks?", "Please summarise what you told me.",
]


async def _run_multi_turn(args: argparse.Namespace, model: str, speculative: bool) -> Report:
    """`--concurrency` conversations of `--turns` turns each, every turn resending the whole
    conversation (as chat clients do): TTFT by turn shows what the prefix cache saves."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/v1/chat/completions"
    by_turn: list[list[RequestResult | BaseException]] = [[] for _ in range(args.turns)]

    async def conversation(client: Any, c: int) -> None:
        messages = [{"role": "system", "content": MULTI_TURN_SYSTEM}]
        for turn in range(args.turns):
            question = MULTI_TURN_QUESTIONS[turn % len(MULTI_TURN_QUESTIONS)]
            messages.append({"role": "user", "content": question.format(n=f"NW-{4400 + c}")})
            body = {"model": model, "messages": messages, "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "ngram": {"enabled": speculative}}
            try:
                result: RequestResult | BaseException = await _one(client, url, headers, body)
            except Exception as e:  # counted; the conversation ends here
                by_turn[turn].append(e)
                return
            by_turn[turn].append(result)
            messages.append({"role": "assistant", "content": result.text})

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, c) for c in range(args.concurrency)))
        duration = time.perf_counter() - t0
    results = [r for turn in by_turn for r in turn]
    report = _report("on" if speculative else "off", args.concurrency, duration, results)
    report.extra["ttft_p50_ms_by_turn"] = [
        float(np.percentile([r.ttft for r in turn if isinstance(r, RequestResult)] or [0.0], 50)
              * 1000) for turn in by_turn]
    return report


async def _run_mode(args: argparse.Namespace, model: str, speculative: bool) -> Report:
    import httpx

    if args.multi_turn:
        return await _run_multi_turn(args, model, speculative)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/v1/chat/completions"
    cases = structured_cases(args.num_prompts) if args.structured else \
        [(PROMPTS[i % len(PROMPTS)], {}, None) for i in range(args.num_prompts)]
    prompts = list(range(len(cases)))
    gate = asyncio.Semaphore(args.concurrency)

    def body(i: int) -> dict[str, Any]:
        prompt, constraint, _ = cases[i]
        return {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ngram": {"enabled": speculative},
                **constraint}

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        async def limited(prompt: int) -> RequestResult | BaseException:
            async with gate:
                try:
                    return await _one(client, url, headers, body(prompt))
                except Exception as e:  # counted, the run goes on
                    return e

        await limited(prompts[0])  # warm-up, not measured
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - t0
    report = _report("on" if speculative else "off", args.concurrency, duration, results)
    if args.structured:
        report.invalid = sum(isinstance(r, RequestResult) and not cases[i][2](r.text)
                             for i, r in enumerate(results))
    return report


def structured_cases(n: int) -> list[tuple[str, dict[str, Any], Any]]:
    """(prompt, constraint fields, check(text) -> bool) for request i of n."""
    import re

    import jsonschema

    from ngramspec.bench.structured_workloads import SCHEMAS, extraction_prompt

    def valid_json(schema: dict[str, Any]) -> Any:
        def check(text: str) -> bool:
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError):
                return False
            return True
        return check

    cases = []
    for i in range(n):
        if i % 10 == 3:
            cases.append(("Give the phone number of the front desk.",
                          {"guided_regex": r"[0-9]{3}-[0-9]{4}"},
                          lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) is not None))
        elif i % 10 == 7:
            options = ["positive", "negative", "neutral"]
            cases.append(("Is 'the food was great' positive, negative or neutral?",
                          {"guided_choice": options}, lambda t, o=options: t in o))
        else:
            name, schema = SCHEMAS[i % len(SCHEMAS)]
            cases.append((extraction_prompt(name, i), {"response_format": {
                "type": "json_schema", "json_schema": {"name": name, "schema": schema}}},
                valid_json(schema)))
    return cases


def _report(mode: str, concurrency: int, duration: float,
            results: list[RequestResult | BaseException]) -> Report:
    ok = [r for r in results if isinstance(r, RequestResult)]
    ttft = [r.ttft for r in ok] or [0.0]
    gaps = [g for r in ok for g in r.gaps] or [0.0]
    tokens = sum(r.output_tokens for r in ok)
    accept = [r.acceptance_length for r in ok if r.acceptance_length]
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000)  # noqa: E731
    return Report(mode, len(results), concurrency, duration, len(ok) / duration,
                  tokens / duration, ms(ttft, 50), ms(ttft, 99), ms(gaps, 50), ms(gaps, 99),
                  float(np.mean(accept)) if accept else 0.0, len(results) - len(ok))


def _served_model(args: argparse.Namespace) -> str:
    import httpx

    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    model = _served_model(args)
    reports = [asyncio.run(_run_mode(args, model, mode == "on")) for mode in args.modes]
    if args.json:
        json.dump([asdict(r) for r in reports], sys.stdout, indent=1)
        print()
        return 0
    print(f"{'spec':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} "
          f"{'ITL p50':>8} {'p99':>8} {'accept':>7} {'errors':>6} {'invalid':>7}")
    for r in reports:
        print(f"{r.mode:>4} {r.requests_per_s:7.2f} {r.output_tokens_per_s:10.1f} "
              f"{r.ttft_p50_ms:7.0f}ms {r.ttft_p99_ms:6.0f}ms {r.itl_p50_ms:6.0f}ms "
              f"{r.itl_p99_ms:6.0f}ms {r.mean_acceptance_length:7.2f} {r.errors:6d} "
              f"{r.invalid:7d}")
        if "ttft_p50_ms_by_turn" in r.extra:
            print("     TTFT p50 by turn (ms): " + "  ".join(
                f"{ms:.0f}" for ms in r.extra["ttft_p50_ms_by_turn"]))
    return 0


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise argparse.ArgumentTypeError("--modes takes on, off or on,off")
    return modes


def register_bench(subparsers: Any) -> None:
    """Add `serve` under `ngramspec bench`; it sets `func(args) -> int`."""
    p = subparsers.add_parser("serve", help="load-test a live server (speculation on and off)",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", type=_modes, default=["on", "off"], help="on,off (default both)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--json", action="store_true")
    p.add_argument("--multi-turn", action="store_true",
                   help="--concurrency conversations of --turns turns on a shared system prompt")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--structured", action="store_true",
                   help="JSON-schema, regex and choice requests, every output checked")
    p.set_defaults(func=run)


register = register_bench  # the name ngramspec/cli/bench.py looks for
