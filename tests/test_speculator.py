"""The draft budget: calibrated estimates and the cost-driven choice of draft sizes (no model)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ngramspec.engine.acceptance import AcceptanceCalibrator
from ngramspec.engine.cost_model import VerifyCost
from ngramspec.engine.speculator import (PER_TREE_OVERHEAD_S, TREE_STEP_OVERHEAD_S,
                                         choose_draft_sizes)
from ngramspec.spec.tree import DraftTree


def chain(probs: list[float]) -> DraftTree:
    n = len(probs) + 1
    return DraftTree([7] * n, [-1] + list(range(n - 1)), [1.0] + probs)


def brute_force_sizes(trees, base, cost):
    """Best prefix sizes by trying every combination (small cases only)."""
    import itertools

    best, best_rate = None, -1.0
    for sizes in itertools.product(*[range(len(t)) for t in trees]):
        expected = len(trees) + sum(sum(t.probs[1 : k + 1]) for t, k in zip(trees, sizes))
        m = sum(sizes)
        rate = expected / (cost(base + m) + _overhead(sizes))
        if rate > best_rate + 1e-12:
            best, best_rate = list(sizes), rate
    return best_rate


def _overhead(sizes: list[int]) -> float:
    if not any(sizes):
        return 0.0
    return TREE_STEP_OVERHEAD_S + PER_TREE_OVERHEAD_S * sum(1 for k in sizes if k)


probs_st = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4).map(
    lambda ps: sorted(ps, reverse=True))


@settings(max_examples=150, deadline=None)
@given(st.lists(probs_st, min_size=1, max_size=3), st.floats(1.0, 3.0))
def test_chosen_sizes_reach_the_best_rate(tree_probs, slope):
    cost = VerifyCost([1, 2, 64], [0.03, 0.03 * (1 + 0.1 * slope), 0.03 * (1 + 3 * slope)])
    trees = [chain(p) for p in tree_probs]
    sizes = choose_draft_sizes(trees, len(trees), cost)
    assert all(0 <= k < len(t) for k, t in zip(sizes, trees))
    m = sum(sizes)
    expected = len(trees) + sum(sum(t.probs[1 : k + 1]) for t, k in zip(trees, sizes))
    rate = expected / (cost(len(trees) + m) + _overhead(sizes))
    # Greedy over the global best-first order is optimal for prefix-closed, sorted probabilities
    # up to the overhead step; it must never do worse than drafting nothing.
    assert rate >= len(trees) / cost(len(trees)) - 1e-12
    assert rate >= brute_force_sizes(trees, len(trees), cost) * 0.97


def test_no_drafts_when_verify_is_expensive():
    steep = VerifyCost([1, 2, 16], [0.03, 0.06, 0.5])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3])], 1, steep) == [0]
    flat = VerifyCost([1, 16], [0.03, 0.031])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3])], 1, flat) == [3]


def test_calibrator_learns_and_keeps_trees_best_first():
    cal = AcceptanceCalibrator()
    tree = chain([0.55, 0.5, 0.45, 0.2])
    before = cal.correct(chain(list(tree.probs[1:]))).probs
    assert all(a >= b for a, b in zip(before, before[1:])), "corrected probs must not increase"
    for _ in range(200):  # nothing is ever accepted: estimates must fall towards zero
        cal.observe(tree.probs, [])
    after = cal.correct(chain(list(tree.probs[1:]))).probs
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert after[1] < 0.05
    for _ in range(400):  # now everything is accepted: they rise above the raw values' prior
        cal.observe(tree.probs, [1, 2, 3, 4])
    rising = cal.correct(chain(list(tree.probs[1:]))).probs
    assert rising[1] > after[1] and rising[1] > 0.5


def test_throughput_guard_penalises_drafting_only_when_it_is_slower():
    from ngramspec.engine.throughput import ThroughputGuard

    guard = ThroughputGuard()
    for _ in range(50):  # at 16 sequences drafting steps are slower: the penalty must rise
        guard.observe(16, drafted=True, tokens=20, seconds=0.2)
        guard.observe(16, drafted=False, tokens=16, seconds=0.1)
    assert guard.penalty_for(16) > 5
    assert guard.penalty_for(1) == 1.0  # other batch sizes are judged on their own
    for _ in range(400):  # drafting now pays: the penalty decays back to 1
        guard.observe(16, drafted=True, tokens=40, seconds=0.1)
    assert guard.penalty_for(16) < 1.5
    probes = sum(guard.should_probe() for _ in range(64))
    assert probes == 4  # one plain probe step in sixteen keeps the plain rate measured
