"""The draft sizing as the plain loop it is (policy/sizing.py `draft_sizes` scores every m at
once in numpy and must decide exactly as this does)."""

from __future__ import annotations

from ngramspec.policy.cost import UNIT_PRICES, Prices, VerifyCost
from ngramspec.policy.sizing import PAY_MARGIN, host_overhead


def reference_draft_sizes(probs: list[list[float]], base_tokens: int, cost: VerifyCost,
                          prices: Prices = UNIT_PRICES) -> list[int]:
    nodes = sorted((-p, t, i) for t, tree in enumerate(probs) for i, p in enumerate(tree) if i > 0)
    expected = float(len(probs))
    base_cost = cost(base_tokens)
    plain = prices.scale * base_cost
    best_m, best_rate = 0, expected / plain
    drafting: set[int] = set()
    for m, (neg_p, t, _) in enumerate(nodes, start=1):
        expected -= neg_p
        drafting.add(t)
        forward = cost(base_tokens + m) - base_cost
        rate = expected / (plain + (prices.penalty * forward
                                    + prices.host * host_overhead(len(drafting))))
        if rate > best_rate:
            best_m, best_rate = m, rate
    if best_rate <= (1 + PAY_MARGIN) * len(probs) / plain:
        best_m = 0  # a gain within the margin is no gain
    sizes = [0] * len(probs)
    for _, t, _ in nodes[:best_m]:
        sizes[t] += 1
    return sizes
