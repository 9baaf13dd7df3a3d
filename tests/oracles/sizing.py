"""The draft sizing as the plain loop it is (engine/speculator.py `choose_draft_sizes` scores
every m at once in numpy and must decide exactly as this does)."""

from __future__ import annotations

from ngramspec.engine.acceptance import MAX_PROB, PRIOR_MASS, PRIOR_RATIO
from ngramspec.engine.cost_model import VerifyCost
from ngramspec.engine.speculator import host_overhead


def reference_draft_sizes(probs: list[list[float]], base_tokens: int, cost: VerifyCost,
                          penalty: float = 1.0, base_scale: float = 1.0) -> list[int]:
    nodes = sorted((-p, t, i) for t, tree in enumerate(probs) for i, p in enumerate(tree) if i > 0)
    expected = float(len(probs))
    base_cost = cost(base_tokens)
    plain = base_scale * base_cost
    best_m, best_rate = 0, expected / plain
    drafting: set[int] = set()
    for m, (neg_p, t, _) in enumerate(nodes, start=1):
        expected -= neg_p
        drafting.add(t)
        extra = cost(base_tokens + m) - base_cost + host_overhead(len(drafting))
        rate = expected / (plain + penalty * extra)
        if rate > best_rate:
            best_m, best_rate = m, rate
    sizes = [0] * len(probs)
    for _, t, _ in nodes[:best_m]:
        sizes[t] += 1
    return sizes


class ReferencePathProbCalibrator:
    """engine/acceptance.py's PathProbCalibrator one node at a time."""

    def __init__(self) -> None:
        self.ratio_buckets = len(PRIOR_RATIO)
        self.predicted = [PRIOR_MASS] * len(PRIOR_RATIO)
        self.accepted = [PRIOR_MASS * r for r in PRIOR_RATIO]

    def _bucket(self, p: float) -> int:
        return min(int(p * self.ratio_buckets), self.ratio_buckets - 1)

    def correct(self, probs: list[float]) -> list[float]:
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
