"""The speculation policy: the cost-driven choice of draft sizes, the step cost learned from
observed steps, and the speculator's back-off (no model)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.sizing import reference_draft_sizes

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.tree import DraftBatch, DraftTree
from ngramspec.engine.scheduler import Schedule, ScheduledChunk
from ngramspec.engine.sequence import Sequence
from ngramspec.engine.speculator import BACKOFF_AFTER, BACKOFF_DRAFT_SHARE, Speculator
from ngramspec.policy.cost import (
    BOUNDS,
    SETTLE_STEPS,
    Prices,
    StepCost,
    VerifyCost,
    batch_bucket,
)
from ngramspec.policy.sizing import (
    PAY_MARGIN,
    PER_TREE_OVERHEAD_S,
    TREE_STEP_OVERHEAD_S,
    choose_draft_sizes,
    may_pay,
    size_one_tree,
    size_trees,
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
    assert rate >= brute_force_sizes(trees, len(trees), cost) * 0.97 / (1 + PAY_MARGIN)


# Trees as the sizing sees them: root 1.0, then non-increasing estimates, with ties.
tree_st = st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.31, 0.5, 0.9, 0.97, 1.0]) | st.floats(0, 1),
                   max_size=11).map(lambda ps: [1.0] + sorted(ps, reverse=True))
cost_st = st.lists(st.tuples(st.integers(1, 600), st.floats(1e-3, 0.05)), min_size=1,
                   max_size=5, unique_by=lambda pt: pt[0]).map(
    lambda pts: VerifyCost(*map(list, zip(*sorted(pts)))))
prices_st = st.builds(Prices, st.sampled_from([1.0, 1.3, 0.7]), st.sampled_from([0.5, 1.0, 3.0]),
                      st.sampled_from([0.2, 1.0, 4.0]))


@settings(max_examples=300, deadline=None)
@given(st.lists(tree_st, min_size=1, max_size=40), cost_st, prices_st)
def test_batched_sizing_decides_as_the_loop(trees, cost, prices):
    assert choose_draft_sizes(trees, len(trees), cost, prices) == \
        reference_draft_sizes(trees, len(trees), cost, prices)
    for tree in trees[:3]:  # one tree alone: the scalar loop the engine runs at one request
        alone = [size_one_tree(tree[1:], 1, cost, prices)]
        assert alone == choose_draft_sizes([tree], 1, cost, prices)
        assert alone == reference_draft_sizes([tree], 1, cost, prices)
    for n in (1, 7, 300, 900):
        assert cost.many(np.array([n]))[0] == cost(n)


def test_no_drafts_when_verify_is_expensive():
    steep = VerifyCost([1, 2, 16], [0.03, 0.06, 0.5])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3]).probs], 1, steep) == [0]
    flat = VerifyCost([1, 16], [0.03, 0.031])
    assert choose_draft_sizes([chain([0.5, 0.4, 0.3]).probs], 1, flat) == [3]


def _fit(cost: StepCost, steps: int, truth: tuple[float, float, float],
         extras: list[tuple[float, float]], n: int = 16, base: float = 0.005) -> None:
    """`steps` rounds of decode steps at batch `n`, one per (forward, host) of `extras` ((0, 0):
    a plain step), whose true seconds are scale * base + penalty * forward + host_f * host."""
    scale, penalty, host_f = truth
    for _ in range(steps):
        for forward, host in extras:
            cost.observe(n, base, forward, host, scale * base + penalty * forward + host_f * host)


# Trees of three sizes (a 5 ms step on a CPU: the host guess is a sixth of it), then plain steps
# until one counts (StepCost leaves out the SETTLE_STEPS right after drafting).
DRAFTING = [(0.0009, 0.0008), (0.004, 0.0008), (0.002, 0.0011)]
VARIED = DRAFTING + [(0.0, 0.0)] * (SETTLE_STEPS + 1)


def test_step_cost_learns_the_true_prices():
    cost = StepCost(VerifyCost([1, 16], [0.05, 0.08]))
    assert cost.prices(16) == Prices()  # nothing observed: trust the curve
    # At 16 sequences a plain step takes 3x the curve, the drafts' forward 4x, the host work 6x.
    _fit(cost, 100, (3.0, 4.0, 6.0), VARIED)
    got = cost.prices(16)
    assert abs(got.scale - 3.0) < 0.05 and abs(got.penalty - 4.0) < 0.2
    assert abs(got.host - 6.0) < 0.5  # within the ridge's pull
    assert cost.prices(1) == Prices()  # other batch sizes are judged on their own
    # Only drafting steps, of varied sizes: no plain step is needed to price the drafts' forward
    # time and the steps seen (a near-constant host guess cannot be told from the scale).
    only_drafting = StepCost(VerifyCost([1, 16], [0.05, 0.08]))
    _fit(only_drafting, 100, (2.0, 3.0, 0.5), DRAFTING)
    got = only_drafting.prices(16)
    assert abs(got.penalty - 3.0) < 0.2
    for forward, host in DRAFTING:
        true = 2.0 * 0.005 + 3.0 * forward + 0.5 * host
        assert abs(got.scale * 0.005 + got.penalty * forward + got.host * host - true) < 0.02 * true


def test_plain_steps_right_after_drafting_do_not_set_the_scale():
    """Plain steps slowed by the drafting step before them (a platform's after-effect) would
    make the scale, and so the plain step, look dearer and drafts cheaper than they are."""
    cost = StepCost(VerifyCost([1, 16], [0.005, 0.008]))
    for _ in range(60):
        cost.observe(1, 0.005, 0.002, 0.0008, 0.005 + 0.002 + 0.0008)  # priced as the curve
        for k in range(SETTLE_STEPS + 2):  # then plain steps, the first ones 40%, 30%, ... slow
            cost.observe(1, 0.005, 0.0, 0.0, 0.005 * (1 + max(0.0, 0.4 - 0.1 * k)))
    got = cost.prices(1)
    assert abs(got.scale - 1.0) < 0.01 and abs(got.penalty - 1.0) < 0.05


def test_step_cost_forgets_dear_drafts_and_is_bounded():
    cost = StepCost(VerifyCost([1, 16], [0.05, 0.08]))
    _fit(cost, 100, (1.0, 30.0, 1.0), VARIED)  # drafting proved very dear
    assert cost.prices(16).penalty > 25.0
    # Then only plain steps: what taught the penalty ages out and it returns to the curve's
    # own price (a policy that stopped drafting tries again), while the scale stays measured.
    _fit(cost, 400, (1.5, 30.0, 1.0), [(0.0, 0.0)])
    got = cost.prices(16)
    assert abs(got.scale - 1.5) < 0.01 and got.penalty < 1.5
    _fit(cost, 600, (1.5, 30.0, 1.0), [(0.0, 0.0)])
    assert abs(cost.prices(16).penalty - 1.0) < 0.01
    dear, free = StepCost(cost.curve), StepCost(cost.curve)
    _fit(dear, 100, (1.0, 1000.0, 1000.0), VARIED)  # absurdly dear drafting is capped
    assert dear.prices(16).penalty == BOUNDS[1][1] and dear.prices(16).host == BOUNDS[2][1]
    _fit(free, 100, (1.0, 0.1, 0.0), VARIED)  # drafts nearly free: floored
    assert free.prices(16).penalty == BOUNDS[1][0] and free.prices(16).host == BOUNDS[2][0]
    given = StepCost(VerifyCost([1, 16], [0.05, 0.08]), learn=False)  # a given curve is kept
    _fit(given, 10, (3.0, 4.0, 2.0), VARIED)
    assert given.prices(16) == Prices()
    cost.reset()
    assert cost.prices(16) == Prices()


def test_corrections_move_the_draft_size_choice():
    flat = VerifyCost([1, 16], [0.03, 0.034])
    tree = chain([0.5, 0.4, 0.3, 0.2])
    assert choose_draft_sizes([tree.probs], 1, flat) == [4]
    assert choose_draft_sizes([tree.probs], 1, flat, Prices(penalty=100.0)) == [0]  # dear drafts
    weak = chain([0.3, 0.2]).probs
    assert choose_draft_sizes([weak], 1, flat) == [2]
    assert choose_draft_sizes([weak], 1, flat, Prices(host=30.0)) == [0]  # dear host work
    # A plain step that really costs 10x the curve makes the same extra relatively cheap.
    steep = VerifyCost([1, 2, 16], [0.03, 0.05, 0.2])
    assert choose_draft_sizes([tree.probs], 1, steep) == [0]
    assert choose_draft_sizes([tree.probs], 1, steep, Prices(scale=10.0))[0] > 0


class _CountingDrafter:
    """Trees of one fixed shape cut to each budget, and the budgets of every call."""

    def __init__(self, probs: list[float]) -> None:
        self.probs, self.budgets = probs, []

    @property
    def calls(self) -> int:
        return len(self.budgets)

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        self.budgets.append(budgets[0])
        return [chain(list(self.probs[:b])) for b in budgets]


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


def test_backed_off_drafting_looks_at_each_best_node_and_drafts_when_it_pays():
    # A verify cost that rises steeply: no draft ever pays, so the sized trees are empty.
    steep = VerifyCost([1, 2, 64], [0.01, 0.05, 5.0])
    drafter = _CountingDrafter([0.05, 0.04, 0.03])
    # drafting a batch takes 1 s, far above BACKOFF_DRAFT_SHARE of a plain step: backing off pays
    spec = Speculator(DrafterConfig(), drafter, steep, clock=_Clock(1.0))
    full = DrafterConfig().num_draft_tokens
    for _ in range(BACKOFF_AFTER + 20):
        assert not any(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    # Every step still looks: whole trees until backing off, then each tree's best node only.
    assert drafter.budgets == [full] * BACKOFF_AFTER + [1] * 20
    # Another batch-size bucket has its own record; it drafts whole trees.
    spec.propose(_decode_schedule(40))
    assert drafter.budgets[-1] == full
    # A loop starts: the look sees a node that pays and whole trees are drafted that same step.
    drafter.probs = [0.999] * 12
    spec.cost = StepCost(VerifyCost([1, 64], [0.01, 0.012]))
    spec._idle[batch_bucket(4)] = BACKOFF_AFTER  # the new cost keeps the record of the old
    trees = spec.propose(_decode_schedule(4))
    assert drafter.budgets[-2:] == [1, full]
    assert all(t.num_drafts for t in trees.values())


def test_cheap_drafting_never_backs_off():
    """Where drafting costs little of a step, a look would save little: whole trees are drafted
    every step, and used as soon as they pay."""
    curve = VerifyCost([1, 4, 8, 64], [0.01, 0.01, 0.016, 0.5])  # 4 decodes + 4 drafts: 1.6x
    drafter = _CountingDrafter([0.05, 0.04, 0.03])
    cheap = _Clock(BACKOFF_DRAFT_SHARE * curve(4) / 2)  # half the share of a plain step
    spec = Speculator(DrafterConfig(), drafter, curve, clock=cheap)
    for _ in range(BACKOFF_AFTER + 20):
        assert not any(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    assert drafter.budgets == [DrafterConfig().num_draft_tokens] * (BACKOFF_AFTER + 20)
    drafter.probs = [0.99, 0.98, 0.97]  # a loop starts: its first step drafts
    assert all(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())


def test_drafting_never_backs_off_while_drafts_pay():
    flat = VerifyCost([1, 2, 64], [0.01, 0.01, 0.01])
    drafter = _CountingDrafter([0.9, 0.8, 0.7])
    spec = Speculator(DrafterConfig(), drafter, flat, clock=_Clock(1.0))
    for _ in range(BACKOFF_AFTER + 20):
        assert all(t.num_drafts for t in spec.propose(_decode_schedule(4)).values())
    assert set(drafter.budgets) == {DrafterConfig().num_draft_tokens}


@settings(max_examples=300, deadline=None)
@given(st.lists(tree_st, min_size=1, max_size=12), cost_st, prices_st, st.integers(0, 40))
def test_the_cheap_no_pay_check_never_changes_a_decision(trees, cost, prices, base):
    """may_pay skips the sizing only where the sizing would keep no draft."""
    batch = DraftBatch.from_trees([chain(list(p[1:])) for p in trees])
    lengths = batch.sizes
    drafts = int(lengths.sum()) - len(lengths)
    base += len(trees)
    if not may_pay(batch.probs, lengths, drafts, base, cost, prices):
        assert not any(choose_draft_sizes(trees, base, cost, prices))
    step = StepCost(cost, learn=False)
    assert size_trees(batch.probs, lengths, base, step, len(trees)) == \
        choose_draft_sizes(trees, base, cost)


def test_new_weights_restart_what_was_learned_of_acceptance_and_step_times():
    class Resetting(_CountingDrafter):
        resets = 0

        def reset_calibration(self) -> None:
            self.resets += 1

    drafter = Resetting([0.5])
    spec = Speculator(DrafterConfig(), drafter, VerifyCost([1, 16], [0.01, 0.02]),
                      learn_step_times=True)
    for _ in range(20):
        spec.cost.observe(1, 0.01, 0.0, 0.0, 0.03)  # plain steps take 3x the curve
    assert spec.cost.prices(1).scale > 2.5
    spec.restart_calibration()
    assert drafter.resets == 1 and spec.cost.prices(1) == Prices()


def test_a_gain_within_the_margin_drafts_nothing():
    flat = VerifyCost([1, 2], [0.01, 0.01])  # one draft costs only the host guess, 0.8 ms
    # A draft of estimate p gives (1 + p) / 1.08 times the plain rate.
    inside = (1 + PAY_MARGIN / 2) * 1.08 - 1  # a gain inside the margin: not worth the risk
    assert choose_draft_sizes([[1.0, inside]], 1, flat) == [0]
    assert reference_draft_sizes([[1.0, inside]], 1, flat) == [0]
    beyond = (1 + 2 * PAY_MARGIN) * 1.08 - 1
    assert choose_draft_sizes([[1.0, beyond]], 1, flat) == [1]
