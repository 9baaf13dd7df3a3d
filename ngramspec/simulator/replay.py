"""Exact replay of greedy speculative decoding over recorded token streams (no model needed).

With greedy verification the target's output does not depend on the drafts, so a recorded output
tells exactly which draft nodes the target would accept. Per request:

    drafter.start(id, prompt_ids)
    drafter.commit(id, [output[0]])          # the prefill's token: not a verify step
    while tokens remain:
        tree = drafter.propose([id], [budget])[0]
        accepted = tree.accepted_nodes(next output tokens)
        emitted = accepted tokens + the bonus token (truncated at the end of the output)
        drafter.commit(id, emitted)          # one verify step
    drafter.stop(id)

mean_accepted = decode tokens / verify steps (bonus included; the prefill token is in neither).
With a step cost (`cost`, policy/cost.py), each tree is first cut to what the speculation policy
would verify (policy/sizing.py, as the engine sizes them) and every step's time is modelled by the
cost curve and the host overhead guess: `modelled_speedup` = the modelled time of plain decoding
over that of speculation, for the same tokens.
With `concurrency = N`, N requests are in flight: each round proposes for all of them in one call,
then verifies and commits each in turn (the engine's order), and a finished request's slot goes to
the next stream in file order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ngramspec.drafting.protocol import Drafter
from ngramspec.drafting.tree import DraftBatch
from ngramspec.policy.cost import StepCost
from ngramspec.policy.sizing import size_trees, step_extras

LOOP_WINDOW = 48
LOOP_MAX_PERIOD = 24


@dataclass(slots=True)
class Stream:
    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    category: str = ""
    file: str = ""


@dataclass(slots=True)
class RequestResult:
    id: str
    category: str
    file: str
    is_looping: bool
    steps: int = 0  # verify steps
    tokens: int = 0  # decode tokens (accepted drafts + bonus), prefill token excluded
    drafted: int = 0  # draft nodes proposed
    propose_us: list[float] = field(default_factory=list)  # per step (batch time / batch size)
    commit_us: list[float] = field(default_factory=list)  # per step
    drafted_by_source: dict[int, int] = field(default_factory=dict)
    accepted_by_source: dict[int, int] = field(default_factory=dict)
    # With a step cost: the request's share of each step's modelled seconds, and of plain
    # decoding's for the same tokens.
    seconds: float = 0.0
    plain_seconds: float = 0.0


def read_streams(paths: Iterable[str | Path]) -> list[Stream]:
    streams = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    streams.append(Stream(str(row["id"]), [int(t) for t in row["prompt_ids"]],
                                          [int(t) for t in row["output_ids"]],
                                          str(row.get("category", "")), str(path)))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{number}: not a stream line "
                                     f'{{"id", "prompt_ids", "output_ids"}} ({e})') from e
    return streams


def is_looping(output_ids: list[int], window: int = LOOP_WINDOW,
               max_period: int = LOOP_MAX_PERIOD) -> bool:
    """True if the last `window` tokens repeat with some period ≤ `max_period`."""
    if len(output_ids) < window:
        return False
    tail = output_ids[-window:]
    return any(all(tail[i] == tail[i + p] for i in range(window - p))
               for p in range(1, max_period + 1))


class _Live:
    """One request being replayed."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.pos = 1  # output tokens committed (the first came from prefill)
        self.result = RequestResult(stream.id, stream.category, stream.file,
                                    is_looping(stream.output_ids))

    @property
    def done(self) -> bool:
        return self.pos >= len(self.stream.output_ids)


def _start(drafter: Drafter, stream: Stream) -> _Live:
    live = _Live(stream)
    drafter.start(stream.id, stream.prompt_ids)
    if stream.output_ids:
        drafter.commit(stream.id, stream.output_ids[:1])  # the prefill's sampled token
    return live


def _verify_and_commit(drafter: Drafter, live: _Live, tree: Any, propose_us: float,
                       seconds: float = 0.0, plain_per_token: float = 0.0) -> None:
    out, pos, r = live.stream.output_ids, live.pos, live.result
    accepted = tree.accepted_nodes(out[pos:pos + tree.num_drafts])
    emitted = out[pos:pos + len(accepted) + 1]  # + bonus, unless the output ends first
    t0 = time.perf_counter()
    drafter.commit(live.stream.id, emitted)
    r.commit_us.append((time.perf_counter() - t0) * 1e6)
    r.propose_us.append(propose_us)
    live.pos += len(emitted)
    r.steps += 1
    r.tokens += len(emitted)
    r.seconds += seconds
    r.plain_seconds += len(emitted) * plain_per_token
    r.drafted += tree.num_drafts
    for node in range(1, len(tree)):
        src = tree.sources[node]
        r.drafted_by_source[src] = r.drafted_by_source.get(src, 0) + 1
    for node in accepted:
        src = tree.sources[node]
        r.accepted_by_source[src] = r.accepted_by_source.get(src, 0) + 1


def replay(drafter: Drafter, streams: list[Stream], budget: int = 11,
           concurrency: int = 1, cost: StepCost | None = None) -> list[RequestResult]:
    """Replay `streams` in order through `drafter`; `budget` = draft nodes per tree (d - 1);
    `cost`: size the trees by the speculation policy and model step times.

    Returns one result per stream, in stream order.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    order = {s.id: i for i, s in enumerate(streams)}
    if len(order) != len(streams):
        raise ValueError("stream ids must be unique (the drafter keys requests by id)")
    pending = iter(streams)
    live: list[_Live] = []
    results: list[RequestResult] = []
    while True:
        while len(live) < concurrency and (stream := next(pending, None)) is not None:
            live.append(_start(drafter, stream))
            if live[-1].done:  # an output of 0 or 1 tokens needs no verify step
                _finish(drafter, live.pop(), results)
        if not live:
            return sorted(results, key=lambda r: order[r.id])
        _round(drafter, live, budget, cost)
        for x in [x for x in live if x.done]:
            live.remove(x)
            _finish(drafter, x, results)


def _finish(drafter: Drafter, live: _Live, results: list[RequestResult]) -> None:
    drafter.stop(live.stream.id)
    results.append(live.result)


def _round(drafter: Drafter, live: list[_Live], budget: int, cost: StepCost | None) -> None:
    """One engine step: propose for every live request at once, then verify and commit each."""
    ids = [x.stream.id for x in live]
    t0 = time.perf_counter()
    trees = drafter.propose(ids, [budget] * len(ids))
    per_request_us = (time.perf_counter() - t0) * 1e6 / len(ids)
    if len(trees) != len(ids):
        raise RuntimeError(f"propose returned {len(trees)} trees for {len(ids)} requests")
    for x, tree in zip(live, trees):
        if tree.num_drafts > budget:
            raise RuntimeError(
                f"{x.stream.id}: tree has {tree.num_drafts} drafts > budget {budget}")
    n, seconds, plain = len(ids), 0.0, 0.0
    if cost is not None:  # the engine's sizing: each tree cut to the drafts that pay
        batch = DraftBatch.from_trees(trees, budget + 1)
        lengths = np.minimum(batch.sizes, budget + 1)
        sizes = size_trees(batch.probs, lengths, n, cost, n)
        trees = batch.prefixes([k + 1 for k in sizes])
        forward, host = step_extras(sizes, n, cost.curve)
        plain = cost.curve(n) / n
        seconds = plain + (forward + host) / n
    for x, tree in zip(live, trees):
        _verify_and_commit(drafter, x, tree, per_request_us, seconds, plain)


# ---- summaries ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Summary:
    requests: int
    steps: int
    tokens: int
    drafted: int
    mean_accepted: float  # decode tokens / verify steps, bonus included
    modelled_speedup: float | None  # plain over speculative modelled seconds (with a step cost)
    propose_us: float  # median µs per request-step
    commit_us: float  # median µs per request-step
    by_source: dict[str, dict[str, float]]  # source -> {drafted, accepted, acceptance}


@dataclass(slots=True)
class Report:
    overall: Summary
    by_file: dict[str, Summary]
    by_category: dict[str, Summary]
    # The same with looping streams left out (docs/reference/replay_findings.md, finding 6).
    overall_no_loops: Summary
    by_file_no_loops: dict[str, Summary]
    by_category_no_loops: dict[str, Summary]
    looping_ids: list[str]
    drafter_stats: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _source_name(src: int) -> str:
    from ngramspec.drafting.sources import SOURCE_NAMES

    return SOURCE_NAMES.get(src, f"source{src}")


def summarize(results: list[RequestResult]) -> Summary:
    steps = sum(r.steps for r in results)
    tokens = sum(r.tokens for r in results)
    by_source: dict[str, dict[str, float]] = {}
    for r in results:
        for src, n in r.drafted_by_source.items():
            entry = by_source.setdefault(_source_name(src), {"drafted": 0, "accepted": 0})
            entry["drafted"] += n
        for src, n in r.accepted_by_source.items():
            entry = by_source.setdefault(_source_name(src), {"drafted": 0, "accepted": 0})
            entry["accepted"] += n
    for entry in by_source.values():
        entry["acceptance"] = entry["accepted"] / entry["drafted"] if entry["drafted"] else 0.0
    return Summary(
        requests=len(results), steps=steps, tokens=tokens, drafted=sum(r.drafted for r in results),
        mean_accepted=tokens / steps if steps else 0.0,
        modelled_speedup=(sum(r.plain_seconds for r in results) / seconds
                          if (seconds := sum(r.seconds for r in results)) > 0 else None),
        propose_us=_median([u for r in results for u in r.propose_us]),
        commit_us=_median([u for r in results for u in r.commit_us]),
        by_source=dict(sorted(by_source.items())),
    )


def _grouped(results: list[RequestResult], key: Callable[[RequestResult], str]
             ) -> dict[str, Summary]:
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {name: summarize(rs) for name, rs in groups.items()}


def report(results: list[RequestResult], drafter: Drafter | None = None) -> Report:
    clean = [r for r in results if not r.is_looping]
    stats = getattr(drafter, "stats", None)
    return Report(
        overall=summarize(results),
        by_file=_grouped(results, lambda r: r.file),
        by_category=_grouped(results, lambda r: r.category),
        overall_no_loops=summarize(clean),
        by_file_no_loops=_grouped(clean, lambda r: r.file),
        by_category_no_loops=_grouped(clean, lambda r: r.category),
        looping_ids=[r.id for r in results if r.is_looping],
        drafter_stats=stats() if callable(stats) else None,
    )


def simulate(drafter: Drafter, streams: list[Stream], budget: int = 11, concurrency: int = 1,
             reset_between_files: bool = False, cost: StepCost | None = None) -> Report:
    """Replay and summarise. By default the drafter keeps what it learned across files, like a
    server would; `reset_between_files` makes each file's numbers independent of file order.
    `cost`: size trees by the speculation policy and model the speed-up (see `replay`)."""
    if not reset_between_files:
        return report(replay(drafter, streams, budget, concurrency, cost), drafter)
    results: list[RequestResult] = []
    for file in dict.fromkeys(s.file for s in streams):
        results += replay(drafter, [s for s in streams if s.file == file], budget, concurrency,
                          cost)
        drafter.reset()
    return report(results, drafter)
