"""How long a forward pass takes for N query tokens: the curve the draft budget follows.

Speculation pays only when the expected extra accepted tokens outweigh the extra verify cost. On
a CPU the cost of N tokens is not linear (a matrix-vector product for one token, matrix-matrix
for more), so we measure the curve once and pick, per step, the draft size that maximises
expected tokens per second.
"""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.engine.scheduler import Scheduler

DEFAULT_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # of --verify-cost
# Measured: every size up to 6 and 10 as well. The CPU kernel's step time is not smooth there
# (kernels/gguf_kernels.cpp splits rows into tiles of at most 5: 5 and 10 rows cost little more
# than 4 and 8, 6 much more), and a tree of 3-5 drafts plus its root lands right in it.
MEASURED_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class VerifyCost:
    """Piecewise-linear step time (seconds) as a function of the total query tokens in a step."""

    def __init__(self, points: list[int], seconds: list[float]) -> None:
        if len(points) != len(seconds) or not points:
            raise ValueError("VerifyCost needs one time per point")
        self.points, self.seconds = list(points), list(seconds)
        self._per_draft: dict[tuple[int, int, float], float] = {}

    def __call__(self, num_tokens: int) -> float:
        pts, secs = self.points, self.seconds
        if num_tokens <= pts[0]:
            return secs[0]
        if num_tokens >= pts[-1]:
            return secs[-1] * num_tokens / pts[-1]
        i = bisect.bisect_left(pts, num_tokens)
        lo, hi = pts[i - 1], pts[i]
        w = (num_tokens - lo) / (hi - lo)
        return secs[i - 1] * (1 - w) + secs[i] * w

    def many(self, num_tokens: np.ndarray) -> np.ndarray:
        """`self(n)` for every n of an int array, with the same float operations in the same
        order (so the draft sizing, which compares these, decides exactly as one call each)."""
        pts, secs = np.asarray(self.points), np.asarray(self.seconds, np.float64)
        n = np.asarray(num_tokens)
        beyond = secs[-1] * n / pts[-1]
        if len(pts) == 1:
            return np.where(n <= pts[0], secs[0], beyond)
        i = np.clip(np.searchsorted(pts, n, side="left"), 1, len(pts) - 1)
        lo, hi = pts[i - 1], pts[i]
        w = (n - lo) / (hi - lo)
        inside = secs[i - 1] * (1 - w) + secs[i] * w
        return np.where(n <= pts[0], secs[0], np.where(n >= pts[-1], beyond, inside))

    def min_extra_per_draft(self, base_tokens: int, max_drafts: int, host: float) -> float:
        """min over m in 1..max_drafts of (self(base + m) - self(base) + host) / m: the least
        step time a draft can add on average (the draft sizing's bound). Cached per argument
        triple; the curve never changes after construction."""
        key = (base_tokens, max_drafts, host)
        value = self._per_draft.get(key)
        if value is None:
            m = np.arange(1, max_drafts + 1)
            extra = self.many(base_tokens + m) - self(base_tokens) + host
            value = self._per_draft[key] = float((extra / m).min())
        return value

    @classmethod
    def from_relative(cls, relative: list[float], points: tuple[int, ...] = DEFAULT_POINTS) -> VerifyCost:
        return cls(list(points[: len(relative)]), list(relative))


def time_forward(runner: ModelRunner, scheduler: Scheduler, batch: int, tokens_per_seq: int,
                 context: int = 256, repeats: int = 3) -> float:
    """Best-of-`repeats` seconds for one forward of `batch` sequences x `tokens_per_seq` queries."""
    per_seq = context + tokens_per_seq
    with scheduler.scratch_slots(batch * per_seq) as slots:
        items = []
        for b in range(batch):
            mine = slots[b * per_seq : (b + 1) * per_seq]
            n = tokens_per_seq
            items.append(ForwardItem([7] * n, list(range(context, context + n)), mine[:context],
                                     mine[context:], None, list(range(n))))
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms up
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.run(items)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best


def measure_cost(runner: ModelRunner, scheduler: Scheduler, max_model_len: int,
                 points: tuple[int, ...] = MEASURED_POINTS, max_tokens: int = 128,
                 rounds: int = 3) -> VerifyCost:
    """Time one forward per point; long prompts are the scheduler's business, so stop at 128.

    Points up to 16 (the draft trees' sizes, cheap to time) are timed in `rounds` passes over
    all of them, keeping each point's best: right after loading, single timings drift +-15%
    from one start to the next, and a slow phase hits whichever point runs then. More work
    never takes less time, so the curve is made non-decreasing.
    """
    context = min(256, max_model_len // 2)
    pts = [p for p in points if p <= max_tokens and context + p <= max_model_len]
    best = {p: float("inf") for p in pts}
    for r in range(rounds):
        for p in pts:
            if r == 0 or p <= 16:
                best[p] = min(best[p], time_forward(runner, scheduler, 1, p, context, repeats=2))
    seconds = [best[p] for p in pts]
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    return VerifyCost(pts, seconds)


def measure_verify_cost(llm, batch_sizes=(1, 16), num_tokens=(1, 2, 4, 8, 16, 32)) -> dict:
    """Forward ms for `n` query tokens per sequence at each batch size (for `bench speed --json`)."""
    eng = llm.engine
    return {f"b{b}": {str(n): 1000 * time_forward(eng.runner, eng.scheduler, b, n)
                      for n in num_tokens} for b in batch_sizes}
