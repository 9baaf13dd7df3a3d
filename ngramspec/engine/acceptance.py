"""Engine-side calibration of the drafter's path-acceptance estimates.

The draft budget trades expected accepted tokens against verify cost, so it needs estimates that
are right on average, not just well ranked. Replays of SmolLM2 Spec-Bench streams showed the
drafter's raw estimates running 1.2-1.8x too high below 0.8 (see docs/ARCHITECTURE.md); those
ratios are the prior, and every verified node updates its bucket online.
"""

from __future__ import annotations

import numpy as np

# Observed accepted / predicted per 0.1-wide bucket of the raw estimate (replayed streams).
PRIOR_RATIO = (0.6, 0.56, 0.58, 0.65, 0.68, 0.8, 0.8, 0.9, 0.94, 1.0)
PRIOR_MASS = 5.0  # predicted probability mass behind each bucket's prior
MAX_PROB = 0.99


class PathProbCalibrator:
    """Global correction of a tree's raw path probabilities, by 0.1-wide bucket.

    Kept as arrays and applied to a whole batch at once: per tree in Python, correcting and
    learning cost a visible share of a large batch's step. Observations wait in a list and are
    added, in the order they came, before the next correction reads the table.
    """

    def __init__(self) -> None:
        self.predicted = np.full(len(PRIOR_RATIO), PRIOR_MASS)
        self.accepted = PRIOR_MASS * np.array(PRIOR_RATIO)
        self._probs: list[float] = []  # observed raw estimates, not yet added
        self._hits: list[bool] = []  # whether each was accepted

    def correct(self, probs: list[float]) -> list[float]:
        """Calibrated copy of a tree's probs (root first), kept non-increasing so every prefix
        stays the best one."""
        return self.correct_rows(np.array([probs], np.float64))[0].tolist()

    def correct_rows(self, probs: np.ndarray) -> np.ndarray:
        """`correct` of every row of probs ([trees, nodes], root first; padding: any values in
        [0, 1], which stay past the real nodes)."""
        self._learn()
        b = _buckets(probs)
        out = np.minimum(probs * self.accepted[b] / self.predicted[b], MAX_PROB)
        out[:, 0] = 1.0
        return np.minimum.accumulate(out, axis=1)

    def correct_best(self, firsts: list[float]) -> list[float]:
        """Each tree's best calibrated estimate from its raw node-1 estimate (`correct_rows`
        keeps rows non-increasing, so node 1 holds a tree's best)."""
        self._learn()
        last = len(PRIOR_RATIO) - 1
        accepted, predicted = self.accepted.tolist(), self.predicted.tolist()
        out = []
        for p in firsts:
            b = min(int(p * len(PRIOR_RATIO)), last)
            out.append(min(p * accepted[b] / predicted[b], MAX_PROB))
        return out

    def observe(self, raw_probs: list[float], accepted_nodes: list[int]) -> None:
        accepted = set(accepted_nodes)
        self._probs += raw_probs[1:]
        self._hits += [i in accepted for i in range(1, len(raw_probs))]

    def _learn(self) -> None:
        if not self._probs:
            return
        probs = np.array(self._probs, np.float64)
        b = _buckets(probs)
        np.add.at(self.predicted, b, probs)  # in order, as one += per node would
        np.add.at(self.accepted, b, np.array(self._hits, np.float64))
        self._probs, self._hits = [], []


def _buckets(probs: np.ndarray) -> np.ndarray:
    """The 0.1-wide bucket of each raw estimate (1.0 joins the last)."""
    return np.minimum((probs * len(PRIOR_RATIO)).astype(np.int64), len(PRIOR_RATIO) - 1)


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

    def scale_rows(self, factors: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """`scale` of every row of probs ([trees, nodes], root first) by its request's factor.
        A constant factor and a constant cap keep each row non-increasing."""
        out = np.minimum(MAX_PROB, probs * factors[:, None])
        out[:, 0] = 1.0
        return np.where(factors[:, None] == 1.0, probs, out)

    def scale(self, key: int, probs: list[float]) -> list[float]:
        """The request's corrected probs (root first); the same list when it has no record."""
        f = self.factor(key)
        if f == 1.0:
            return probs
        return self.scale_rows(np.array([f]), np.array([probs], np.float64))[0].tolist()

    def observe(self, key: int, expected: float, accepted: int) -> None:
        s = self.stats.setdefault(key, [0.0, 0.0])
        s[0] += expected
        s[1] += accepted

    def forget(self, key: int) -> None:
        self.stats.pop(key, None)
