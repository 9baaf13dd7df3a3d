"""How long a forward pass takes for N query tokens: the curve the draft budget follows.

Speculation pays only when the expected extra accepted tokens outweigh the extra verify cost. On
a CPU the cost of N tokens is not linear (a matrix-vector product for one token, matrix-matrix
for more), so we measure the curve once and pick, per step, the draft size that maximises
expected tokens per second.
"""

from __future__ import annotations

import bisect
import time

import torch

from ngramspec.engine.model_runner import ForwardItem, ModelRunner
from ngramspec.engine.scheduler import Scheduler

DEFAULT_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class VerifyCost:
    """Piecewise-linear step time (seconds) as a function of the total query tokens in a step."""

    def __init__(self, points: list[int], seconds: list[float]) -> None:
        if len(points) != len(seconds) or not points:
            raise ValueError("VerifyCost needs one time per point")
        self.points, self.seconds = list(points), list(seconds)

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
                 points: tuple[int, ...] = DEFAULT_POINTS, max_tokens: int = 128) -> VerifyCost:
    """Time one forward per point; long prompts are the scheduler's business, so stop at 128."""
    context = min(256, max_model_len // 2)
    pts = [p for p in points if p <= max_tokens and context + p <= max_model_len]
    return VerifyCost(pts, [time_forward(runner, scheduler, 1, p, context, repeats=2) for p in pts])


def measure_verify_cost(llm, batch_sizes=(1, 16), num_tokens=(1, 2, 4, 8, 16, 32)) -> dict:
    """Forward ms for `n` query tokens per sequence at each batch size (for `bench speed --json`)."""
    eng = llm.engine
    return {f"b{b}": {str(n): 1000 * time_forward(eng.runner, eng.scheduler, b, n)
                      for n in num_tokens} for b in batch_sizes}
