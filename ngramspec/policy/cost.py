"""The step-time curve the draft sizing prices drafts with.

`VerifyCost` is the forward time against query tokens, measured once at start for one sequence
(engine/cost_model.py) or given. On a CPU the cost of N tokens is not linear (a matrix-vector
product for one token, matrix-matrix for more), so the sizing reads it point by point.

`StepCost` keeps that curve true at the batch sizes actually served: at a larger batch a step
costs more than the curve says for the same tokens (every sequence attends over its own K/V), the
curve measured at start can be off by a slow phase, and the host work of verifying trees is only
guessed (sizing.host_overhead). Each decode-only step's seconds fit, per batch-size bucket,

    seconds ~= scale * curve(base) + penalty * (curve(base + m) - curve(base)) + host * guess

(m drafts, `guess` the host overhead of its drafting trees; both 0 on a plain step), by least
squares over recent steps pulled towards (1, 1, 1): `Prices`. Plain steps measure the scale,
drafting steps of varied sizes all three, so no step is ever kept from drafting to measure them;
as the steps that taught a high price age out of the window, the prices return to the curve's
own, and a policy that stopped drafting because drafts were dear tries them again. The plain
steps within SETTLE_STEPS of a drafting one are left out: on some CPUs a many-row step slows the
steps after it, and counted in the scale that time would make drafts look cheaper than they are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

DEFAULT_POINTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # of --verify-cost

# A fitted step's weight decays by DECAY per later step of its bucket (a window of ~50 steps).
# The prior (1, 1, 1) is a ridge term, in units of (relative feature)^2: SCALE_PRIOR weighs as one
# plain step; PENALTY_PRIOR as one step whose drafts add half a plain step (0.5^2), or 25 that add
# a tenth; HOST_PRIOR as two steps whose host guess is a sixth of a plain step.
DECAY = 0.98
SETTLE_STEPS = 4
SCALE_PRIOR = 1.0
PENALTY_PRIOR = 0.25
HOST_PRIOR = 0.05
BOUNDS = ((0.25, 16.0), (0.5, 50.0), (0.1, 50.0))  # (low, high) of scale, penalty, host


class VerifyCost:
    """Piecewise-linear step time (seconds) as a function of the total query tokens in a step."""

    def __init__(self, points: list[int], seconds: list[float]) -> None:
        if len(points) != len(seconds) or not points:
            raise ValueError("VerifyCost needs one time per point")
        self.points, self.seconds = list(points), list(seconds)
        # (base tokens, max drafts) -> forward extras as an array and a list, and their least
        # mean per draft; the curve never changes after construction
        self._extras: dict[tuple[int, int], tuple[np.ndarray, list[float], float]] = {}

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

    def _extras_of(self, base_tokens: int, max_drafts: int
                   ) -> tuple[np.ndarray, list[float], float]:
        key = (base_tokens, max_drafts)
        got = self._extras.get(key)
        if got is None:
            m = np.arange(1, max_drafts + 1)
            extras = self.many(base_tokens + m) - self(base_tokens)
            extras.flags.writeable = False
            got = self._extras[key] = (extras, extras.tolist(), float((extras / m).min()))
        return got

    def forward_extras(self, base_tokens: int, max_drafts: int) -> np.ndarray:
        """self(base + m) - self(base) for m = 1..max_drafts (read-only, cached)."""
        return self._extras_of(base_tokens, max_drafts)[0]

    def forward_extras_list(self, base_tokens: int, max_drafts: int) -> list[float]:
        """`forward_extras` as a Python list (cached)."""
        return self._extras_of(base_tokens, max_drafts)[1]

    def min_extra_per_draft(self, base_tokens: int, max_drafts: int) -> float:
        """min over m in 1..max_drafts of (self(base + m) - self(base)) / m: the least forward
        time a draft can add on average (the draft sizing's bound; cached)."""
        return self._extras_of(base_tokens, max_drafts)[2]

    @classmethod
    def from_relative(cls, relative: list[float],
                      points: tuple[int, ...] = DEFAULT_POINTS) -> VerifyCost:
        return cls(list(points[: len(relative)]), list(relative))


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes learned about together: 1, 2-3, 4-7, 8-15, 16-31, 32+."""
    return min(num_seqs.bit_length(), 6)


@dataclass(frozen=True, slots=True)
class Prices:
    """What the sizing multiplies the curve's parts by (StepCost's fit; all 1: the curve)."""

    scale: float = 1.0  # of the plain step, curve(base)
    penalty: float = 1.0  # of the drafts' forward time, curve(base + m) - curve(base)
    host: float = 1.0  # of the drafting trees' host overhead guess


UNIT_PRICES = Prices()


class _Fit:
    """Decayed least squares of y = seconds / curve(base) against x = (1, forward / curve(base),
    host / curve(base)) (relative terms, so that one prior suits every model and machine)."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        # x1 x1, x1 x2, x1 x3, x2 x2, x2 x3, x3 x3, then x1 y, x2 y, x3 y (x1 = 1)
        self.sums = [0.0] * 9

    def add(self, x2: float, x3: float, y: float) -> None:
        terms = (1.0, x2, x3, x2 * x2, x2 * x3, x3 * x3, y, x2 * y, x3 * y)
        self.sums = [DECAY * a + t for a, t in zip(self.sums, terms)]

    def solve(self) -> Prices:
        """The normal equations with the ridge towards (1, 1, 1), by Cramer's rule (a 3x3
        system; numpy's solver costs more than the step can spare at one request)."""
        n, s2, s3, s22, s23, s33, y1, y2, y3 = self.sums
        a = ((n + SCALE_PRIOR, s2, s3), (s2, s22 + PENALTY_PRIOR, s23),
             (s3, s23, s33 + HOST_PRIOR))
        b = (y1 + SCALE_PRIOR, y2 + PENALTY_PRIOR, y3 + HOST_PRIOR)
        det = _det(a)
        theta = []
        for col in range(3):
            m = tuple(tuple(b[r] if c == col else a[r][c] for c in range(3)) for r in range(3))
            theta.append(_det(m) / det)
        return Prices(*(min(hi, max(lo, v)) for v, (lo, hi) in zip(theta, BOUNDS)))


def _det(m: tuple[tuple[float, ...], ...]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


class StepCost:
    """The curve, priced per batch-size bucket from observed decode-only steps (see the module
    docstring). Without `learn` (a curve that was given, not measured here) it is the curve."""

    def __init__(self, curve: VerifyCost, learn: bool = True) -> None:
        self.curve = curve
        self.learn = learn
        self._fits: dict[int, _Fit] = {}
        self._solved: dict[int, Prices] = {}
        self._since_draft = SETTLE_STEPS  # observed steps since the last drafting one

    def prices(self, num_seqs: int) -> Prices:
        """The prices of a step of `num_seqs` decoding sequences."""
        b = batch_bucket(num_seqs)
        got = self._solved.get(b)
        if got is None:
            fit = self._fits.get(b)
            got = self._solved[b] = fit.solve() if fit is not None else UNIT_PRICES
        return got

    def observe(self, num_seqs: int, base: float, forward: float, host: float,
                seconds: float) -> None:
        """A decode-only step: the curve's time for its plain tokens, the curve's extra for its
        drafts, the host overhead guess of its drafting trees (both 0 on a plain step), and the
        step's true seconds."""
        if not self.learn or seconds <= 0 or base <= 0:
            return
        self._since_draft = 0 if forward or host else self._since_draft + 1
        if 0 < self._since_draft <= SETTLE_STEPS:
            return  # a plain step still slowed by the drafts before it
        b = batch_bucket(num_seqs)
        self._fits.setdefault(b, _Fit()).add(forward / base, host / base, seconds / base)
        self._solved.pop(b, None)

    def reset(self) -> None:
        self._fits.clear()
        self._solved.clear()
        self._since_draft = SETTLE_STEPS
