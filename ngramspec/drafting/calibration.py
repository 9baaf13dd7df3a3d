"""Online calibration of draft acceptance per (evidence class, matched-length bucket).

A source proposes a token with a raw estimate `count / (occurrences + 1)` (normalised within that
source only). How far raw estimates are from the truth depends on the source, on how long the
matched context was and on whether the match was seen once or several times, so each (class,
bucket) keeps a multiplicative factor = (observed acceptances + prior) / (sum of raw estimates +
prior), learned from every drafted node whose parent was accepted (a "trial": the verifier
actually judged it).

The class is the source and whether the matched suffix had one earlier occurrence only (a
"unique" match: raw = 1/2 whatever the evidence): one earlier occurrence of a long match is
copied far more reliably than a 1-in-2 split of several occurrences, which the raw estimate
cannot tell apart. Wildcard matches and the trie
fallback (drafting/config.py `max_wildcards`, `trie_fallback`), and all that descends from them,
have classes of their own ("context/skip", "trie/skip", ...): what follows a match that skips
the request's new last token is a weaker copy than what follows a match that ends at it, and
the fallback's matches have length 0, a bucket of their own.

The request's own recent acceptance then scales the estimate, per source: each request keeps a
gain per source = (accepted + g) / (predicted + g) over the nodes that source won and the
verifier judged in the request's recent steps (each step's sums decay by a factor first),
"predicted" being each node's estimate before the gain (kept per node: the estimate is capped
at MAX_CONDITIONAL, so dividing the gain back out would understate it and let a copying
request's gain climb without bound). A request that is copying gets deeper chains from the
source it copies, one writing new text wider trees. A token two sources agree on keeps the
best source's estimate alone: the agreement adds nothing the per-source gain does not.
"""

from __future__ import annotations

import numpy as np

from ngramspec.drafting.sources import NUM_SOURCES, SOURCE_NAMES

# Upper edges (inclusive) of the matched-length buckets: 1, 2, 3, 4, 5-6, 7-8, 9-12, ... , 33+.
BUCKET_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
NUM_BUCKETS = len(BUCKET_EDGES) + 1
# A conditional estimate never reaches 1: path probabilities must strictly reflect risk.
MAX_CONDITIONAL = 0.98
# Evidence class = 2 * source + unique (the matched suffix had at most one earlier occurrence),
# plus SKIP_CLASSES for a wildcard match or the trie fallback; kernels/drafter.cpp `evidence_class`
# computes it.
SKIP_CLASSES = 2 * NUM_SOURCES
NUM_CLASSES = 2 * SKIP_CLASSES
# Columns of SourceCalibrator.settings, the scalars the kernels read: the factors' prior (mass,
# weight), the request gain's prior weight (0: no gain) and per-step decay.
PRIOR_MASS, PRIOR_WEIGHT, GAIN_PRIOR, GAIN_DECAY = range(4)
# A request's gain state, after its tree (kernels/drafter.cpp RequestTree): per source, the
# accepted and predicted sums at 2 * source + GAIN_ACCEPTED / GAIN_PREDICTED.
GAIN_ACCEPTED, GAIN_PREDICTED = range(2)
GAIN_FLOATS = 2 * NUM_SOURCES


def class_name(cls: int) -> str:
    name = SOURCE_NAMES[cls % SKIP_CLASSES // 2]
    if cls >= SKIP_CLASSES:
        name += "/skip"
    return f"{name}/unique" if cls % 2 else name


class SourceCalibrator:
    """The calibration tables in one float64 array that the native kernels read and update in place.

    cal[0] raw sums, cal[1] acceptances, cal[2] trials, cal[3] factors, each [class, bucket];
    `settings` (columns PRIOR_MASS ... GAIN_DECAY). The update is kernels/drafter.cpp `learn`, the
    estimate its `TreeBuild::estimate` (tests/oracles/calibration.py is their list-based
    reference).
    """

    def __init__(self, enabled: bool, prior_weight: float, prior_factor: float = 1.0,
                 gain_prior: float = 0.0, gain_decay: float = 1.0) -> None:
        self.enabled = enabled
        self.prior_weight = prior_weight
        self.prior_factor = prior_factor
        # Uncalibrated estimates are raw: no gain scales them (so none is learned or reported).
        self.settings = np.array([prior_weight * prior_factor, prior_weight,
                                  gain_prior if enabled else 0.0, gain_decay], np.float64)
        self.reset()

    def reset(self) -> None:
        self.cal = np.zeros((4, NUM_CLASSES, NUM_BUCKETS), np.float64)
        self.cal[3] = self.prior_factor

    def request_gain(self, sums: list[float], src: int) -> float:
        """A request's gain of `src` from its sums (GAIN_FLOATS; drafter.cpp
        `Calibration::gain_of`): 1 when the gain is off."""
        g = float(self.settings[GAIN_PRIOR])
        if g <= 0.0:
            return 1.0
        return (sums[2 * src + GAIN_ACCEPTED] + g) / (sums[2 * src + GAIN_PREDICTED] + g)

    def stats(self) -> dict[str, dict[str, list[float]]]:
        """Per class ("context", "context/unique", ...): trials, acceptance rate and learned
        factor per length bucket."""
        out = {}
        for cls in range(NUM_CLASSES):
            trials = [int(t) for t in self.cal[2, cls].tolist()]
            accepted = self.cal[1, cls].tolist()
            out[class_name(cls)] = {
                "trials": trials,
                "accept_rate": [a / t if t else 0.0 for a, t in zip(accepted, trials)],
                "factor": self.cal[3, cls].tolist(),
            }
        return out
