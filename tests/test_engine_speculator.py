"""The draft budget: calibrated estimates and the cost-driven choice of draft sizes (no model)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.sizing import ReferencePathProbCalibrator, reference_draft_sizes

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.tree import DraftTree
from ngramspec.engine.acceptance import PathProbCalibrator
from ngramspec.engine.cost_model import VerifyCost
from ngramspec.engine.scheduler import Schedule, ScheduledChunk
from ngramspec.engine.sequence import Sequence
from ngramspec.engine.speculator import (
    IDLE_AFTER,
    IDLE_DRAFT_SHARE,
    IDLE_PROBE_EVERY,
    PER_TREE_OVERHEAD_S,
    TREE_STEP_OVERHEAD_S,
    Speculator,
    choose_draft_sizes,
)
from ngramspec.sampling_params import SamplingParams


def chain(probs: list[float]) -> DraftTree:
    n = len(probs) + 1
    return DraftTree([7] * n, [-1] + list(range(n - 1)), [1.0] + probs)


def brute_force_sizes(trees, base, cost):
    """Best prefix sizes by trying every combination (small cases only)."""
    import itertools

    best_rate = -1.0
    for sizes in itertools.product(*[range(len(t)) for t in trees]):
        expected = len(trees) + sum(sum(t.probs[1 : k + 1]) for t, k in zip(trees, sizes))
        m = sum(sizes)
        rate = expected / (cost(base + m) + _overhead(sizes))
        if rate > best_rate + 1e-12:
            best_rate = rate
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
    sizes = choose_draft_sizes([t.probs for t in trees], len(trees), cost)
    assert all(0 <= k < len(t) for k, t in zip(sizes, trees))
    m = sum(sizes)
    expected = len(trees) + sum(sum(t.probs[1 : k + 1]) for t, k in zip(trees, sizes))
    rate = expected / (cost(len(trees) + m) + _overhead(sizes))
    # Greedy over the global best-first order is optimal for prefix-closed, sorted probabilities
    # up to the overhead step; it must never do worse than drafting nothing.
    assert rate >= len(trees) / cost(len(trees)) - 1e-12
    assert rate >= brute_force_sizes(trees, len(trees), cost) * 0.97


# Trees as the sizing sees them: root 1.0, then non-increasing estimates, with ties.
tree_st = st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.31, 0.5, 0.9, 0.97, 1.0]) | st.floats(0, 1),
                   max_size=11).map(lambda ps: [1.0] + sorted(ps, reverse=True))
cost_st = st.lists(st.tuples(st.integers(1, 600), st.floats(1e-3, 0.05)), min_size=1,
                   max_size=5, unique_by=lambda pt: pt[0]).map(
    lambda pts: VerifyCost(*map(list, zip(*sorted(pts)))))


@settings(max_examples=300, deadline=None)
@given(st.lists(tree_st, min_size=1, max_size=40), cost_st, st.sampled_from([0.5, 1.0, 3.0]),
       st.sampled_from([1.0, 1.3]))
def test_batched_sizing_decides_as_the_loop(trees, cost, penalty, base_scale):
    assert choose_draft_sizes(trees, len(trees), cost, penalty, base_scale) == \
        reference_draft_sizes(trees, len(trees), cost, penalty, base_scale)
    for n in (1, 7, 300, 900):
        assert cost.many(np.array([n]))[0] == cost(n)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(tree_st, st.lists(st.integers(1, 11), max_size=4)), max_size=12))
def test_batched_calibrator_matches_the_one_node_at_a_time_loop(steps):
    fast, ref = PathProbCalibrator(), ReferencePathProbCalibrator()
    for probs, accepted in steps:
        assert fast.correct(probs) == ref.correct(probs)
        fast.observe(probs, accepted)
        ref.observe(probs, accepted)
    probe = [1.0, 0.95, 0.7, 0.42, 0.42, 0.1, 0.0]
    assert fast.correct(probe) == ref.correct(probe)


def test_no_drafts_when_verify_is_expensive():
    steep = VerifyCost([1, 2, 16], [0.03, 0.06, 0.5])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3]).probs], 1, steep) == [0]
    flat = VerifyCost([1, 16], [0.03, 0.031])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3]).probs], 1, flat) == [3]


def test_calibrator_learns_and_keeps_trees_best_first():
    cal = PathProbCalibrator()
    tree = chain([0.55, 0.5, 0.45, 0.2])
    before = cal.correct(chain(list(tree.probs[1:])).probs)
    assert all(a >= b for a, b in zip(before, before[1:])), "corrected probs must not increase"
    for _ in range(200):  # nothing is ever accepted: estimates must fall towards zero
        cal.observe(tree.probs, [])
    after = cal.correct(chain(list(tree.probs[1:])).probs)
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert after[1] < 0.05
    for _ in range(400):  # now everything is accepted: they rise above the raw values' prior
        cal.observe(tree.probs, [1, 2, 3, 4])
    rising = cal.correct(chain(list(tree.probs[1:])).probs)
    assert rising[1] > after[1] and rising[1] > 0.5


def test_throughput_guard_learns_the_true_base_and_extra_costs():
    from ngramspec.engine.throughput import MAX_PENALTY, PROBE_EVERY, ThroughputGuard

    guard = ThroughputGuard()
    assert guard.correction(16) == (1.0, 1.0)  # nothing observed: trust the curve
    guard.observe(16, 0.05, 0.08, 0.3)  # a drafting step before any plain one teaches nothing
    assert guard.correction(16) == (1.0, 1.0)
    for _ in range(100):
        # At 16 sequences a plain step takes 3x the curve; drafting adds 4x the predicted extra.
        guard.observe(16, 0.05, 0.05, 0.15)
        guard.observe(16, 0.05, 0.08, 0.15 + 4 * 0.03)
    scale, penalty = guard.correction(16)
    assert abs(scale - 3.0) < 1e-6 and abs(penalty - 4.0) < 1e-6
    assert guard.correction(1) == (1.0, 1.0)  # other batch sizes are judged on their own
    for _ in range(200):  # drafting became cheap: the penalty falls to its floor, not below
        guard.observe(16, 0.05, 0.05, 0.15)
        guard.observe(16, 0.05, 0.08, 0.15)
    assert guard.correction(16)[1] == 0.5
    for _ in range(200):  # absurdly dear drafting is capped
        guard.observe(16, 0.05, 0.05, 0.15)
        guard.observe(16, 0.05, 0.051, 10.0)
    assert guard.correction(16)[1] == MAX_PENALTY
    probes = sum(guard.should_probe() for _ in range(4 * PROBE_EVERY))
    assert probes == 4  # one plain probe step in PROBE_EVERY keeps the plain base measured


def test_corrections_move_the_draft_size_choice():
    flat = VerifyCost([1, 16], [0.03, 0.034])
    tree = chain([0.5, 0.4, 0.3, 0.2])
    assert choose_draft_sizes([tree.probs], 1, flat) == [4]
    assert choose_draft_sizes([tree.probs], 1, flat, penalty=50.0) == [0]  # drafting proved dear
    # A plain step that really costs 10x the curve makes the same extra relatively cheap.
    steep = VerifyCost([1, 2, 16], [0.03, 0.05, 0.2])
    assert choose_draft_sizes([tree.probs], 1, steep) == [0]
    assert choose_draft_sizes([tree.probs], 1, steep, base_scale=10.0)[0] > 0


def test_request_acceptance_scales_one_request_by_its_own_record():
    from ngramspec.engine.acceptance import MAX_PROB, RequestAcceptance

    ra = RequestAcceptance(prior_tokens=3.0)
    tree = chain([0.6, 0.5, 0.4])
    assert ra.scale(1, chain(list(tree.probs[1:])).probs) == tree.probs  # no record: unchanged
    for _ in range(10):  # request 1 accepts nothing of an expected 1.5 tokens per step
        ra.observe(1, 1.5, 0)
        ra.observe(2, 1.0, 2)  # request 2 accepts twice what was expected
    assert abs(ra.factor(1) - 3.0 / 18.0) < 1e-12
    low = ra.scale(1, chain(list(tree.probs[1:])).probs)
    assert all(abs(a - b * 3.0 / 18.0) < 1e-12 for a, b in zip(low[1:], tree.probs[1:]))
    high = ra.scale(2, chain(list(tree.probs[1:])).probs)
    assert high[1] == MAX_PROB and all(a >= b for a, b in zip(high[1:], high[2:]))
    cost = VerifyCost([1, 2, 16], [0.03, 0.036, 0.06])
    assert choose_draft_sizes([chain([0.6, 0.5, 0.4]).probs], 1, cost)[0] > 0
    assert choose_draft_sizes([ra.scale(1, chain([0.6, 0.5, 0.4]).probs)], 1, cost) == [0]
    ra.forget(1)
    assert ra.factor(1) == 1.0 and ra.factor(2) > 1.0


class _CountingDrafter:
    """Trees of one fixed shape, and a count of the batches it was asked for."""

    def __init__(self, probs: list[float]) -> None:
        self.probs, self.calls = probs, 0

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        self.calls += 1
        return [chain(list(self.probs)) for _ in request_ids]


def _decode_schedule(n: int) -> Schedule:
    params = SamplingParams(temperature=0.0)
    seqs = [Sequence(i, f"r{i}", [5, 6, 7], 2, params, (2,), use_spec=True) for i in range(n)]
    return Schedule([ScheduledChunk(s, 2, [1 + s.seq_id]) for s in seqs], [], 10_000)


class _Clock:
    """A clock that moves `tick` seconds a reading: each drafting call takes `tick`."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_drafting_pauses_while_sized_trees_keep_nothing_and_probes():
    # A verify cost that rises steeply: no draft ever pays, so the sized trees are empty.
    steep = VerifyCost([1, 2, 64], [0.01, 0.05, 5.0])
    drafter = _CountingDrafter([0.05, 0.04, 0.03])
    # drafting a batch takes 1 s, far above IDLE_DRAFT_SHARE of a plain step: pausing pays
    spec = Speculator(DrafterConfig(), drafter, steep, clock=_Clock(1.0))
    steps = IDLE_AFTER + 3 * IDLE_PROBE_EVERY
    for _ in range(steps):
        assert not any(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    assert drafter.calls == IDLE_AFTER + 3  # then one probe every IDLE_PROBE_EVERY steps
    # Another batch-size bucket has its own record; it drafts until it learns the same.
    spec.propose(_decode_schedule(40))
    assert drafter.calls == IDLE_AFTER + 4


def test_cheap_drafting_never_pauses():
    """Where drafting costs little of a step, a pause would save little and miss the first steps
    of a repeat: the drafter keeps looking, and drafts as soon as its trees pay."""
    curve = VerifyCost([1, 4, 8, 64], [0.01, 0.01, 0.016, 0.5])  # 4 decodes + 4 drafts: 1.6x
    drafter = _CountingDrafter([0.05, 0.04, 0.03])
    cheap = _Clock(IDLE_DRAFT_SHARE * curve(4) / 2)  # half the share of a plain step
    spec = Speculator(DrafterConfig(), drafter, curve, clock=cheap)
    for _ in range(IDLE_AFTER + 2 * IDLE_PROBE_EVERY):
        assert not any(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    assert drafter.calls == IDLE_AFTER + 2 * IDLE_PROBE_EVERY
    drafter.probs = [0.99, 0.98, 0.97]  # a loop starts: its first step drafts
    assert all(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())


def test_drafting_never_pauses_while_drafts_pay():
    flat = VerifyCost([1, 2, 64], [0.01, 0.01, 0.01])
    drafter = _CountingDrafter([0.9, 0.8, 0.7])
    spec = Speculator(DrafterConfig(), drafter, flat)
    for _ in range(IDLE_AFTER + 2 * IDLE_PROBE_EVERY):
        assert all(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    assert drafter.calls == IDLE_AFTER + 2 * IDLE_PROBE_EVERY


class _FixedDrafter:
    """The same trees every call, one per request."""

    def __init__(self, trees: list[list[float]]) -> None:
        self.trees = trees

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        return [chain(list(p[1:])) for p, _ in zip(self.trees, request_ids)]


@settings(max_examples=300, deadline=None)
@given(st.lists(tree_st, min_size=1, max_size=12), cost_st,
       st.lists(st.tuples(st.floats(0, 20), st.integers(0, 20)), min_size=12, max_size=12),
       st.lists(st.tuples(tree_st, st.lists(st.integers(1, 11), max_size=4)), max_size=6))
def test_the_cheap_no_pay_check_never_changes_a_decision(trees, cost, records, history):
    """Speculator._may_pay skips the sizing only where the sizing would keep no draft: the
    trees, expectations and predicted costs equal those of a speculator that always sizes."""
    def make() -> Speculator:
        spec = Speculator(DrafterConfig(), _FixedDrafter(trees), cost)
        for i, (expected, accepted) in enumerate(records):
            spec.per_request.observe(i, expected, accepted)
        for probs, accepted in history:
            spec.calibrator.observe(probs, accepted)
        return spec

    checked, full = make(), make()
    full._may_pay = lambda *args: True  # type: ignore[method-assign]
    schedule = _decode_schedule(len(trees))
    got, want = checked.propose(schedule), full.propose(schedule)
    assert {k: (t.token_ids, t.probs) for k, t in got.items() if t.num_drafts} == \
        {k: (t.token_ids, t.probs) for k, t in want.items() if t.num_drafts}
    assert checked._expected == full._expected
    assert checked._predicted == full._predicted
