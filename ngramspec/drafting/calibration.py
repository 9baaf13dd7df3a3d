"""Online calibration of draft acceptance per (source, matched-length bucket).

A source proposes a token with a raw estimate `count / (occurrences + 1)` (normalised within that
source only; replay_findings lesson 4). How far raw estimates are from the truth depends on the
source and on how long the matched context was, so each (source, bucket) keeps a multiplicative
factor = (observed acceptances + prior) / (sum of raw estimates + prior), learned from every
drafted node whose parent was accepted (a "trial": the verifier actually judged it).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from ngramspec.drafting.sources import NUM_SOURCES, SOURCE_NAMES

# Upper edges (inclusive) of the matched-length buckets: 1, 2, 3, 4, 5-6, 7-8, 9-12, ... , 33+.
BUCKET_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
NUM_BUCKETS = len(BUCKET_EDGES) + 1
# A conditional estimate never reaches 1: path probabilities must strictly reflect risk.
MAX_CONDITIONAL = 0.98


def length_bucket(length: int) -> int:
    return bisect_right(BUCKET_EDGES, length - 1)


class AcceptanceCalibrator:
    def __init__(self, enabled: bool, prior_weight: float, prior_factor: float = 1.0) -> None:
        self.enabled = enabled
        self.prior_weight = prior_weight
        self.prior_factor = prior_factor
        self.reset()

    def reset(self) -> None:
        def table(value: float) -> list[list[float]]:
            return [[value] * NUM_BUCKETS for _ in range(NUM_SOURCES)]

        self._raw_sum = table(0.0)
        self._accepted = table(0.0)
        self._trials = [[0] * NUM_BUCKETS for _ in range(NUM_SOURCES)]
        self._factor = table(self.prior_factor)
        self._prior_mass = self.prior_weight * self.prior_factor

    def estimate(self, source: int, length: int, raw: float) -> float:
        """Calibrated probability that the verifier accepts this token given its parent."""
        factor = self._factor[source][length_bucket(length)] if self.enabled else 1.0
        return min(MAX_CONDITIONAL, raw * factor)

    def observe(self, source: int, length: int, raw: float, accepted: bool) -> None:
        b = length_bucket(length)
        self._raw_sum[source][b] += raw
        self._accepted[source][b] += 1.0 if accepted else 0.0
        self._trials[source][b] += 1
        self._factor[source][b] = (self._accepted[source][b] + self._prior_mass) / (
            self._raw_sum[source][b] + self.prior_weight
        )

    def stats(self) -> dict[str, dict[str, list[float]]]:
        """Per source: trials, acceptance rate and learned factor per length bucket."""
        out = {}
        for source, name in SOURCE_NAMES.items():
            trials = self._trials[source]
            out[name] = {
                "trials": list(trials),
                "accept_rate": [
                    a / t if t else 0.0 for a, t in zip(self._accepted[source], trials)
                ],
                "factor": list(self._factor[source]),
            }
        return out


class ArrayCalibrator(AcceptanceCalibrator):
    """The same calibration kept in one float64 array that the numba kernels update in place.

    cal[0] raw sums, cal[1] acceptances, cal[2] trials, cal[3] factors, each [source, bucket];
    `prior` = (prior mass, prior weight). Same arithmetic in the same order as the lists of
    AcceptanceCalibrator, so both give bit-identical estimates.
    """

    def reset(self) -> None:
        self.cal = np.zeros((4, NUM_SOURCES, NUM_BUCKETS), np.float64)
        self.cal[3] = self.prior_factor
        self.prior = np.array([self.prior_weight * self.prior_factor, self.prior_weight])

    def estimate(self, source: int, length: int, raw: float) -> float:
        factor = float(self.cal[3, source, length_bucket(length)]) if self.enabled else 1.0
        return min(MAX_CONDITIONAL, raw * factor)

    def observe(self, source: int, length: int, raw: float, accepted: bool) -> None:
        cal, b = self.cal, length_bucket(length)
        cal[0, source, b] += raw
        cal[1, source, b] += 1.0 if accepted else 0.0
        cal[2, source, b] += 1
        mass, weight = self.prior
        cal[3, source, b] = (cal[1, source, b] + mass) / (cal[0, source, b] + weight)

    def stats(self) -> dict[str, dict[str, list[float]]]:
        out = {}
        for source, name in SOURCE_NAMES.items():
            trials = [int(t) for t in self.cal[2, source].tolist()]
            accepted = self.cal[1, source].tolist()
            out[name] = {
                "trials": trials,
                "accept_rate": [a / t if t else 0.0 for a, t in zip(accepted, trials)],
                "factor": self.cal[3, source].tolist(),
            }
        return out
