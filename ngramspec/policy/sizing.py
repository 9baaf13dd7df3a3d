"""Which drafted nodes to verify: those that raise expected tokens per second of step time.

A node's estimate is the drafter's calibrated probability that its whole path is accepted
(drafting/calibration.py learns it per evidence class and match length, and per request); the
step's price is `StepCost`. Keeping the m most likely nodes of the batch yields
num_trees + sum(p) expected tokens for

    scale * curve(base) + penalty * (curve(base + m) - curve(base)) + host * host_overhead(trees)

seconds (`Prices`; `trees` that draft anything among the m); the sizing takes the best m. Trees
are best-first, so every tree keeps a prefix.
"""

from __future__ import annotations

import numpy as np

from ngramspec.policy.cost import UNIT_PRICES, Prices, StepCost, VerifyCost

# Drafts are kept only where they raise the modelled tokens per second by more than this share:
# a marginal draft gains nothing on average, and costs what the model leaves out.
PAY_MARGIN = 0.05

# Host-side cost of verifying trees rather than single tokens: per step (mask building) and per
# tree that drafts anything (tree walk, slot bookkeeping, drafter feedback).
TREE_STEP_OVERHEAD_S = 5e-4
PER_TREE_OVERHEAD_S = 3e-4


def host_overhead(num_trees: int) -> float:
    """Host-side seconds of a step that verifies `num_trees` drafting trees (0 if none)."""
    return TREE_STEP_OVERHEAD_S + PER_TREE_OVERHEAD_S * num_trees if num_trees else 0.0


def size_trees(probs: np.ndarray, lengths: np.ndarray, base_tokens: int, cost: StepCost,
               num_seqs: int) -> list[int]:
    """Drafts to keep per tree: probs [trees, width] path estimates, root first (columns past
    a tree's `lengths[i]` nodes are ignored); `num_seqs` decoding sequences in the step."""
    num = len(lengths)
    prices = cost.prices(num_seqs)
    if num == 1:
        return [size_one_tree(probs[0, 1:int(lengths[0])].tolist(), base_tokens, cost.curve,
                              prices)]
    drafts_in = int(lengths.sum()) - num
    if not may_pay(probs, lengths, drafts_in, base_tokens, cost.curve, prices):
        return [0] * num
    width = int(lengths.max())
    drafts = (np.arange(width) < lengths[:, None]) & (np.arange(width) > 0)  # [trees, width]
    return draft_sizes(probs[:, :width][drafts], np.nonzero(drafts)[0], num, base_tokens,
                       cost.curve, prices)


def size_one_tree(p: list[float], base_tokens: int, curve: VerifyCost,
                  prices: Prices = UNIT_PRICES) -> int:
    """`size_trees` of one best-first tree (its drafts' estimates `p`), as a loop over Python
    floats: at one request the batch's numpy calls would cost a visible share of the step. It
    decides as `draft_sizes` does, with the same float operations in the same order."""
    if not p or not _bound_pays(p[0], 1, len(p), base_tokens, curve, prices):
        return 0
    plain = prices.scale * curve(base_tokens)
    host = prices.host * host_overhead(1)
    expected, best_m, best_rate = 1.0, 0, -1.0
    for m, (q, forward) in enumerate(zip(p, curve.forward_extras_list(base_tokens, len(p))),
                                     start=1):
        expected += q
        rate = expected / (plain + (prices.penalty * forward + host))
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m if best_rate > (1 + PAY_MARGIN) / plain else 0


def may_pay(probs: np.ndarray, lengths: np.ndarray, max_drafts: int, base_tokens: int,
            curve: VerifyCost, prices: Prices = UNIT_PRICES) -> bool:
    """False when no draft can pay, so `draft_sizes` would keep none: a cheap bound that spares
    the sizing on the steps (most, on free text) where nothing pays.

    Taking m <= max_drafts drafts adds at most m * p_max expected tokens (p_max: the best
    node's estimate, node 1 of its best-first tree) for at least
    m * (penalty * min_extra_per_draft + host * host_overhead(1) / max_drafts) of step time;
    if even that ratio does not beat the plain step's tokens per second, nothing pays. The
    margin keeps rounding on the sizing's side.
    """
    drafting = lengths > 1
    if max_drafts <= 0 or not drafting.any():
        return False
    return _bound_pays(float(probs[drafting, 1].max()), len(lengths), max_drafts, base_tokens,
                       curve, prices)


def _bound_pays(p_max: float, num: int, max_drafts: int, base_tokens: int, curve: VerifyCost,
                prices: Prices) -> bool:
    """`may_pay`'s bound for `num` trees whose best node's estimate is p_max."""
    per_draft = (prices.penalty * curve.min_extra_per_draft(base_tokens, max_drafts)
                 + prices.host * host_overhead(1) / max_drafts)
    return (p_max * prices.scale * curve(base_tokens)
            > (1 - 1e-9) * (1 + PAY_MARGIN) * num * per_draft)


def choose_draft_sizes(probs: list[list[float]], base_tokens: int, cost: VerifyCost,
                       prices: Prices = UNIT_PRICES) -> list[int]:
    """`draft_sizes` of trees given as lists: probs[t][i] node i's estimate, root first."""
    drafts = np.fromiter((len(tree) - 1 for tree in probs), np.int64, len(probs))
    p = np.array([x for tree in probs for x in tree[1:]], np.float64)
    return draft_sizes(p, np.repeat(np.arange(len(probs)), drafts), len(probs), base_tokens,
                       cost, prices)


def draft_sizes(p: np.ndarray, tree_of: np.ndarray, num: int, base_tokens: int,
                cost: VerifyCost, prices: Prices = UNIT_PRICES) -> list[int]:
    """Drafts to keep per tree, given the batch's drafts flattened in (tree, node) order: p[j]
    the estimate of draft j, tree_of[j] its tree (of `num`), priced by `prices`.

    Every m is scored at once in numpy (a Python loop over a large batch's drafts costs a
    visible share of its step); tests/oracles/sizing.py is that loop, which this matches
    decision for decision: the same float operations in the same order.
    """
    plain = prices.scale * cost(base_tokens)
    total = len(p)
    if total == 0:
        return [0] * num
    # Best first; a stable sort keeps ties in (tree, node) order, as sorting (-p, t, i) would.
    order = np.argsort(-p, kind="stable")
    p, tree_of = p[order], tree_of[order]
    first = np.zeros(total, np.int64)
    first[np.unique(tree_of, return_index=True)[1]] = 1
    drafting = np.cumsum(first)  # trees drafting anything among the first m nodes
    host = TREE_STEP_OVERHEAD_S + PER_TREE_OVERHEAD_S * drafting  # host_overhead, m >= 1
    expected = np.cumsum(np.concatenate(([float(num)], p)))[1:]  # after each node m = 1..
    rate = expected / (plain + (prices.penalty * cost.forward_extras(base_tokens, total)
                                + prices.host * host))
    best = int(np.argmax(rate))  # the first of the best, as a strict > scan would keep
    best_m = best + 1 if rate[best] > (1 + PAY_MARGIN) * num / plain else 0
    return np.bincount(tree_of[:best_m], minlength=num).tolist()


def step_extras(sizes: list[int], base_tokens: int, curve: VerifyCost) -> tuple[float, float]:
    """The curve's extra forward time for these draft sizes, and their host overhead guess."""
    drafts = sum(sizes)
    if not drafts:
        return 0.0, 0.0
    return (curve(base_tokens + drafts) - curve(base_tokens),
            host_overhead(sum(1 for k in sizes if k)))
