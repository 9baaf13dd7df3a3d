"""Measuring how long a forward pass takes for N query tokens: the curve (policy/cost.py
`VerifyCost`) the draft sizing follows, timed once at start."""

from __future__ import annotations

import time

import torch

from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.engine.scheduler import Scheduler
from ngramspec.policy.cost import VerifyCost

# Measured: every size up to 6 and 10 as well. The CPU kernel's step time is not smooth there
# (kernels/gguf_kernels.cpp splits rows into tiles of at most 5: 5 and 10 rows cost little more
# than 4 and 8, 6 much more), and a tree of 3-5 drafts plus its root lands right in it.
MEASURED_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SETTLE_RUNS = 8


def time_forward(runner: ModelRunner, scheduler: Scheduler, batch: int, tokens_per_seq: int,
                 context: int = 256, repeats: int = 3, warmups: int = 1) -> float:
    """Best-of-`repeats` seconds for one forward of `batch` sequences x `tokens_per_seq` queries,
    after `warmups` untimed ones."""
    per_seq = context + tokens_per_seq
    with scheduler.scratch_slots(batch * per_seq) as slots:
        items = []
        for b in range(batch):
            mine = slots[b * per_seq : (b + 1) * per_seq]
            n = tokens_per_seq
            items.append(ForwardItem([7] * n, list(range(context, context + n)), mine[:context],
                                     mine[context:], None, list(range(n))))
        best = float("inf")
        for run in range(warmups + repeats):
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.run(items)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if run >= warmups:
                best = min(best, time.perf_counter() - t0)
        return best


def measure_cost(runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 points: tuple[int, ...] = MEASURED_POINTS, max_tokens: int = 128,
                 rounds: int = 3) -> VerifyCost:
    """Time one forward per point; long prompts are the scheduler's business, so stop at 128.

    Points up to 16 (the draft trees' sizes, cheap to time) are timed in `rounds` passes over
    all of them, keeping each point's best: right after loading, single timings drift +-15%
    from one start to the next, and a slow phase hits whichever point runs then. More work
    never takes less time, so the curve is made non-decreasing. Each round's first point comes
    after SETTLE_RUNS untimed forwards of its size: on some CPUs the one-token steps after a
    many-token one run slow for a few steps, which plain decoding never sees, and one token
    timed right after the last round's 16 would make the first draft look free.
    """
    context = min(256, max_model_len // 2)
    pts = [p for p in points if p <= max_tokens and context + p <= max_model_len]
    best = {p: float("inf") for p in pts}
    for r in range(rounds):
        for p in pts:
            if r == 0 or p <= 16:
                settle = SETTLE_RUNS if p == pts[0] else 1
                best[p] = min(best[p], time_forward(runner, scheduler, 1, p, context, repeats=2,
                                                    warmups=settle))
    seconds = [best[p] for p in pts]
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    return VerifyCost(pts, seconds)


def measure_verify_cost(llm, batch_sizes=(1, 16), num_tokens=(1, 2, 4, 8, 16, 32)) -> dict:
    """Forward ms for `n` query tokens per sequence at each batch size (for `bench speed --json`)."""
    eng = llm.engine
    return {f"b{b}": {str(n): 1000 * time_forward(eng.runner, eng.scheduler, b, n)
                      for n in num_tokens} for b in batch_sizes}
