"""Engine-side calibration of the drafter's path-acceptance estimates.

The draft budget trades expected accepted tokens against verify cost, so it needs estimates that
are right on average, not just well ranked. Replays of SmolLM2 Spec-Bench streams showed the
drafter's raw estimates running 1.2-1.8x too high below 0.8 (see docs/ARCHITECTURE.md); those
ratios are the prior, and every verified node updates its bucket online.
"""

from __future__ import annotations

# Observed accepted / predicted per 0.1-wide bucket of the raw estimate (replayed streams).
PRIOR_RATIO = (0.6, 0.56, 0.58, 0.65, 0.68, 0.8, 0.8, 0.9, 0.94, 1.0)
PRIOR_MASS = 5.0  # predicted probability mass behind each bucket's prior
MAX_PROB = 0.99


class PathProbCalibrator:
    """Global correction of a tree's raw path probabilities, by 0.1-wide bucket."""

    def __init__(self) -> None:
        self.predicted = [PRIOR_MASS] * len(PRIOR_RATIO)
        self.accepted = [PRIOR_MASS * r for r in PRIOR_RATIO]

    @staticmethod
    def _bucket(p: float) -> int:
        return min(int(p * len(PRIOR_RATIO)), len(PRIOR_RATIO) - 1)

    def correct(self, probs: list[float]) -> list[float]:
        """Calibrated copy of a tree's probs (root first), kept non-increasing so every prefix
        stays the best one."""
        out, floor = [1.0], 1.0
        for p in probs[1:]:
            b = self._bucket(p)
            floor = min(floor, MAX_PROB, p * self.accepted[b] / self.predicted[b])
            out.append(floor)
        return out

    def observe(self, raw_probs: list[float], accepted_nodes: list[int]) -> None:
        accepted = set(accepted_nodes)
        for i in range(1, len(raw_probs)):
            b = self._bucket(raw_probs[i])
            self.predicted[b] += raw_probs[i]
            self.accepted[b] += i in accepted


# Pseudo-tokens of "as expected" behind every request's own correction: a few verify steps are
# not enough to judge a request, twenty are.
REQUEST_PRIOR_TOKENS = 3.0


class RequestAcceptance:
    """Per-request correction on top of the global calibration.

    The global calibrator is right on average over all requests, but some requests (free-form
    writing) accept far less than average and others (edits) far more, so a request's observed
    accepted / expected ratio, shrunk towards 1 by a prior, scales its estimates: drafting dies
    down where it keeps failing and grows where it keeps succeeding.
    """

    def __init__(self, prior_tokens: float = REQUEST_PRIOR_TOKENS) -> None:
        self.prior = prior_tokens
        self.stats: dict[int, list[float]] = {}  # key -> [expected, accepted]

    def factor(self, key: int) -> float:
        expected, accepted = self.stats.get(key, (0.0, 0.0))
        return (accepted + self.prior) / (expected + self.prior)

    def scale(self, key: int, probs: list[float]) -> list[float]:
        """The request's corrected probs (root first); the same list when it has no record."""
        f = self.factor(key)
        if f == 1.0:
            return probs
        # A constant factor and a constant cap keep the probs non-increasing.
        return [1.0] + [min(MAX_PROB, p * f) for p in probs[1:]]

    def observe(self, key: int, expected: float, accepted: int) -> None:
        s = self.stats.setdefault(key, [0.0, 0.0])
        s[0] += expected
        s[1] += accepted

    def forget(self, key: int) -> None:
        self.stats.pop(key, None)
