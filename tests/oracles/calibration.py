"""List-based reference of drafting/calibration.py: the per-(cls, bucket) update and estimate
that kernels/drafter.cpp `learn` and `TreeBuild::estimate` compute, in the same order."""

from __future__ import annotations

from bisect import bisect_right

from ngramspec.drafting.calibration import (
    BUCKET_EDGES,
    MAX_CONDITIONAL,
    NUM_BUCKETS,
    NUM_CLASSES,
    class_name,
)


def length_bucket(length: int) -> int:
    return bisect_right(BUCKET_EDGES, length - 1)


class ReferenceCalibrator:
    def __init__(self, enabled: bool, prior_weight: float, prior_factor: float = 1.0,
                 gain_prior: float = 0.0, gain_decay: float = 1.0) -> None:
        self.enabled = enabled
        self.prior_weight = prior_weight
        self.prior_factor = prior_factor
        self.gain_prior = gain_prior if enabled else 0.0  # raw estimates: no gain
        self.gain_decay = gain_decay
        self.reset()

    def reset(self) -> None:
        def table(value: float) -> list[list[float]]:
            return [[value] * NUM_BUCKETS for _ in range(NUM_CLASSES)]

        self._raw_sum = table(0.0)
        self._accepted = table(0.0)
        self._trials = [[0] * NUM_BUCKETS for _ in range(NUM_CLASSES)]
        self._factor = table(self.prior_factor)
        self._prior_mass = self.prior_weight * self.prior_factor

    def estimate(self, cls: int, length: int, raw: float,
                 gain: float = 1.0) -> tuple[float, float]:
        """Calibrated probability that the verifier accepts this token given its parent, for
        a request whose gain is `gain`, and the same before the gain."""
        p = raw * self._factor[cls][length_bucket(length)] if self.enabled else raw
        return min(MAX_CONDITIONAL, p * gain), min(MAX_CONDITIONAL, p)

    def gain(self, sums: dict[int, list[float]], source: int) -> float:
        """A request's gain for `source` from its sums {source: [accepted, predicted]}; 1 when
        off."""
        if self.gain_prior <= 0:
            return 1.0
        accepted, predicted = sums[source]
        return (accepted + self.gain_prior) / (predicted + self.gain_prior)

    def observe_request(self, sums: dict[int, list[float]],
                        judged: list[tuple[int, bool, float]]) -> None:
        """One verify step of a request: decay its sums, then add each judged node (its
        winning source, accepted, its conditional estimate before the gain) to its source's."""
        for pair in sums.values():
            pair[0] *= self.gain_decay
            pair[1] *= self.gain_decay
        for source, ok, base in judged:
            sums[source][0] += 1.0 if ok else 0.0
            sums[source][1] += base

    def observe(self, cls: int, length: int, raw: float, accepted: bool) -> None:
        b = length_bucket(length)
        self._raw_sum[cls][b] += raw
        self._accepted[cls][b] += 1.0 if accepted else 0.0
        self._trials[cls][b] += 1
        self._factor[cls][b] = (self._accepted[cls][b] + self._prior_mass) / (
            self._raw_sum[cls][b] + self.prior_weight
        )

    def stats(self) -> dict[str, dict[str, list[float]]]:
        """Per class: trials, acceptance rate and learned factor per length bucket."""
        out = {}
        for cls in range(NUM_CLASSES):
            name = class_name(cls)
            trials = self._trials[cls]
            out[name] = {
                "trials": list(trials),
                "accept_rate": [
                    a / t if t else 0.0 for a, t in zip(self._accepted[cls], trials)
                ],
                "factor": list(self._factor[cls]),
            }
        return out
