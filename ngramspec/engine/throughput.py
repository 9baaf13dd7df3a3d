"""Learn online how far the start-up cost curve is off at the batch sizes actually served.

The cost curve is measured at start-up for one sequence. At larger batches a step costs more than
the curve says for the same number of tokens (every sequence gathers and attends over its own
K/V), and host overheads add to verify steps. So each decode-only step reports its seconds, and
per batch-size bucket two corrections are learned:
- `base_scale`: observed / predicted time of plain (non-drafting) steps;
- `penalty`: observed / predicted *extra* time of drafting steps over that corrected base.
The draft-size choice then weighs expected tokens against the corrected costs. Acceptance is not
judged here (the acceptance calibrator does that), so a category with poor drafts cannot teach
the engine that verifying is dear. One step in `PROBE_EVERY` skips drafting so the plain base
stays measured while drafting runs.
"""

from __future__ import annotations

PROBE_EVERY = 32
EMA = 0.1
MIN_PENALTY = 0.5
MAX_PENALTY = 50.0


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes learned about together: 1, 2-3, 4-7, 8-15, 16-31, 32+."""
    return min(num_seqs.bit_length(), 6)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class ThroughputGuard:
    def __init__(self) -> None:
        self.base_scale: dict[int, float] = {}
        self.extra_observed: dict[int, float] = {}  # EMA of seconds beyond the corrected base
        self.extra_predicted: dict[int, float] = {}  # EMA of what the curve predicted for them
        self.steps = 0

    def correction(self, num_seqs: int) -> tuple[float, float]:
        """(base_scale, penalty) for a step of `num_seqs` decoding sequences."""
        b = batch_bucket(num_seqs)
        scale = self.base_scale.get(b, 1.0)
        predicted = self.extra_predicted.get(b)
        if not predicted:
            return scale, 1.0
        ratio = self.extra_observed[b] / predicted
        return scale, min(MAX_PENALTY, max(MIN_PENALTY, ratio))

    def should_probe(self) -> bool:
        self.steps += 1
        return self.steps % PROBE_EVERY == 0

    def observe(self, num_seqs: int, base_predicted: float, step_predicted: float,
                seconds: float) -> None:
        """A decode-only step: the curve's time without and with its drafts, and the truth."""
        if seconds <= 0 or base_predicted <= 0:
            return
        b = batch_bucket(num_seqs)
        if step_predicted <= base_predicted:  # a plain step
            self.base_scale[b] = _ema(self.base_scale.get(b), seconds / base_predicted)
            return
        scale = self.base_scale.get(b)
        if scale is None:
            return  # nothing to measure the extra against yet
        extra = seconds - scale * base_predicted
        self.extra_observed[b] = _ema(self.extra_observed.get(b), extra)
        self.extra_predicted[b] = _ema(self.extra_predicted.get(b),
                                       step_predicted - base_predicted)
