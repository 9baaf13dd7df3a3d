"""Speculator: the engine's side of n-gram speculation: what to draft, how much of it to verify,
and what the verify steps teach the drafter and the calibrators. It holds no KV slots and no
engine state: trees go back to the engine, counters go back as values."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.protocol import Drafter
from ngramspec.drafting.tree import DraftBatch, DraftTree
from ngramspec.engine.acceptance import MAX_PROB, PathProbCalibrator, RequestAcceptance
from ngramspec.engine.cost_model import VerifyCost
from ngramspec.engine.scheduler import Schedule, ScheduledChunk
from ngramspec.engine.sequence import Sequence, SpecCounters
from ngramspec.engine.throughput import ThroughputGuard, batch_bucket
from ngramspec.engine.verify import VerifyResult


class Speculator:
    def __init__(self, config: DrafterConfig, drafter: Drafter, cost: VerifyCost | None,
                 learn_step_times: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        """`cost` is the verify-cost curve trees are sized by; None verifies every tree whole (the
        SGLang way). `learn_step_times` corrects that curve from observed step times, which only
        makes sense when it was measured here rather than given. `clock` times the drafting."""
        self.config = config
        self.drafter = drafter
        self.cost = cost
        self.calibrator = PathProbCalibrator()
        self.per_request = RequestAcceptance()
        self._expected: dict[int, float] = {}  # seq_id -> calibrated expected accepted this step
        self.guard = ThroughputGuard() if cost is not None and learn_step_times else None
        self._predicted: tuple[float, float] | None = None  # (base, step) seconds of this step
        # per batch-size bucket: sized steps in a row that kept no draft, and steps since the
        # last draft while idle (see IDLE_AFTER)
        self._idle: dict[int, int] = {}
        self._skipped: dict[int, int] = {}
        self.clock = clock
        self._draft_seconds: dict[int, float] = {}  # per bucket: a drafting call's seconds (average)

    def restart_calibration(self) -> None:
        """New weights: what was learned about acceptance no longer holds (the drafter's
        n-gram statistics, which are model-free, stay)."""
        self.calibrator = PathProbCalibrator()
        self.per_request = RequestAcceptance()
        self._expected.clear()
        self._idle.clear()  # whether drafts pay is for the new weights to show
        self._skipped.clear()
        if self.guard is not None:
            self.guard = ThroughputGuard()

    def start(self, seq: Sequence, references: list[list[int]] | None) -> None:
        self.drafter.start(seq.request_id, seq.token_ids, references)

    def stop(self, seq: Sequence) -> None:
        self.drafter.stop(seq.request_id)
        self.per_request.forget(seq.seq_id)
        self._expected.pop(seq.seq_id, None)

    def overlap(self) -> None:
        """Drafting work that needs nothing from the step in flight (the learning queued by new
        requests' prompts, the heaviest part), done while the accelerator runs that step."""
        flush = getattr(self.drafter, "flush", None)  # optional in the Drafter protocol
        if flush is not None:
            flush()

    def propose(self, schedule: Schedule) -> dict[int, DraftTree]:
        """seq_id -> the tree to verify, for the decodes that speculate this step."""
        self._predicted = None
        chunks = [c for c in schedule.decodes if c.seq.use_spec]
        if not chunks or schedule.spare_tokens <= 0:
            return {}
        budget = min(self.config.num_draft_tokens, schedule.spare_tokens // len(chunks))
        bucket = batch_bucket(len(schedule.decodes))
        if budget <= 0 or self._idle_skip(bucket, schedule.base_tokens):
            return {}
        start = self.clock()
        trees = self.drafter.propose([c.seq.request_id for c in chunks], [budget] * len(chunks))
        took = self.clock() - start
        last = self._draft_seconds.get(bucket)
        self._draft_seconds[bucket] = took if last is None else 0.8 * last + 0.2 * took
        # At least budget + 1 columns: a grammar's forced chain may fill all of them.
        batch = DraftBatch.from_trees(trees, budget + 1)
        # Under a grammar: forced tokens first, forbidden nodes out, before anything is sized.
        for i, c in enumerate(chunks):
            if c.seq.grammar is not None:
                batch.replace(i, c.seq.grammar.constrain(batch.tree(i)))
        lengths = np.minimum(batch.sizes, budget + 1)  # nodes, root included
        if self.cost is not None:
            sizes = self._size(chunks, batch, lengths, schedule, self.cost)
        else:
            sizes = (lengths - 1).tolist()
        out: dict[int, DraftTree] = {}
        if not any(sizes):  # the engine verifies a root-only tree for every chunk left out
            return out
        for chunk, tree in zip(chunks, batch.prefixes([k + 1 for k in sizes])):
            # The root is the sequence's last token whatever the drafter says: never trust a
            # drafter with what the model sees.
            tree.token_ids[0] = chunk.seq.token_ids[-1]
            out[chunk.seq.seq_id] = tree
        return out

    def _size(self, chunks: list[ScheduledChunk], batch: DraftBatch, lengths: np.ndarray,
              schedule: Schedule, cost: VerifyCost) -> list[int]:
        """The drafts of each tree (its first `lengths[i]` nodes) that pay for their verify cost.

        Trees keep the drafter's estimates (what the global calibrator learns from; they already
        carry the drafter's per-request, per-source gain); the sizing uses them calibrated
        globally and then per request.
        """
        num = len(batch)
        base = schedule.base_tokens
        scale, penalty, probe = 1.0, 1.0, False
        if self.guard is not None:
            scale, penalty = self.guard.correction(len(schedule.decodes))
            probe = self.guard.should_probe()
        factors = [self.per_request.factor(c.seq.seq_id) for c in chunks]
        if probe or not self._may_pay(batch, lengths, factors, base, cost, penalty, scale):
            sizes = [0] * num
            for c in chunks:
                self._expected[c.seq.seq_id] = 0.0
        else:
            sizes = self._best_sizes(chunks, batch, lengths, np.array(factors), base, cost,
                                     penalty, scale)
        if not probe:
            bucket = batch_bucket(len(schedule.decodes))
            self._idle[bucket] = 0 if any(sizes) else self._idle.get(bucket, 0) + 1
        self._predicted = (cost(base), predicted_step_cost(sizes, base, cost))
        return sizes

    def _may_pay(self, batch: DraftBatch, lengths: np.ndarray, factors: list[float], base: int,
                 cost: VerifyCost, penalty: float, scale: float) -> bool:
        """False when no draft of the batch can pay, so `draft_sizes` would keep none: a cheap
        bound that spares the sizing on the steps (most, on free text) where nothing pays.

        Taking m drafts adds at most m * p_max expected tokens (p_max: the best node's estimate,
        as the sizing calibrates it) for at least m * cost.min_extra_per_draft of step time; if
        even that ratio does not beat the plain step's tokens per second at any m, nothing
        pays. The margin keeps rounding on the sizing's side.
        """
        total = int(lengths.sum()) - len(lengths)  # drafts in the batch (roots excluded)
        if total <= 0:
            return False
        # A tree's best node is node 1 (trees are best-first, and the calibrations keep each
        # row non-increasing); the batch's best is the largest of those.
        drafting = lengths > 1
        best = self.calibrator.correct_best(batch.probs[drafting, 1].tolist())
        p_max = max((min(MAX_PROB, p * f) if f != 1.0 else p)
                    for p, f in zip(best, np.asarray(factors)[drafting].tolist()))
        per_draft = cost.min_extra_per_draft(base, total, host_overhead(1))
        return p_max * scale * cost(base) > (1 - 1e-9) * len(lengths) * penalty * per_draft

    def _best_sizes(self, chunks: list[ScheduledChunk], batch: DraftBatch, lengths: np.ndarray,
                    factors: np.ndarray, base: int, cost: VerifyCost, penalty: float,
                    scale: float) -> list[int]:
        """draft_sizes over the batch's calibrated estimates; records what each request is
        expected to accept."""
        num = len(batch)
        width = int(lengths.max())
        held = np.arange(width) < lengths[:, None]  # [trees, width]: the nodes each tree has
        raw = np.where(held, batch.probs[:, :width], 0.0)  # columns past a tree's end: undefined
        calibrated = self.calibrator.correct_rows(raw)
        probs = self.per_request.scale_rows(factors, calibrated)
        drafts = held & (np.arange(width) > 0)  # the root is never a draft
        sizes = draft_sizes(probs[drafts], np.nonzero(drafts)[0], num, base, cost, penalty, scale)
        # What per_request will check: each tree's calibrated probs summed over its kept drafts.
        sums = np.cumsum(calibrated[:, 1:], axis=1).tolist() if width > 1 else [[]] * num
        for c, k, row in zip(chunks, sizes, sums):
            self._expected[c.seq.seq_id] = row[k - 1] if k else 0.0
        return sizes

    def _idle_skip(self, bucket: int, base_tokens: int) -> bool:
        """Whether to skip drafting this step: the cost-sized trees at this batch size have kept
        nothing for IDLE_AFTER steps in a row, and drafting costs at least IDLE_DRAFT_SHARE of a
        plain step (on a GPU at 64 requests of chat it cost a third of every step). A pause saves
        only the drafting, so where that is cheap the drafter keeps looking: a loop or a repeat
        that starts is drafted at its first step, not at the next probe. When paused, one step in
        IDLE_PROBE_EVERY still drafts, to see whether drafts pay again."""
        if self.cost is None or self._idle.get(bucket, 0) < IDLE_AFTER:
            return False
        if self._draft_seconds.get(bucket, 0.0) < IDLE_DRAFT_SHARE * self.cost(base_tokens):
            return False
        skipped = self._skipped.get(bucket, 0) + 1
        self._skipped[bucket] = 0 if skipped >= IDLE_PROBE_EVERY else skipped
        return skipped < IDLE_PROBE_EVERY

    def after_step(self, schedule: Schedule, seconds: float) -> None:
        """Feed a decode-only step's time to the guard (prefill steps are not comparable)."""
        if (self.guard is not None and self._predicted is not None and schedule.decodes
                and not schedule.prefills):
            self.guard.observe(len(schedule.decodes), *self._predicted, seconds)

    def observe(self, seq: Sequence, tree: DraftTree, result: VerifyResult,
                appended: list[int]) -> SpecCounters | None:
        """Learn from one request's verify step; its counters, or None for a prefill's token."""
        self.drafter.commit(seq.request_id, appended)
        if seq.num_tokens - len(appended) <= seq.num_prompt_tokens:
            return None  # the first token comes from prefill, not from a verify step
        if self.cost is not None and tree.num_drafts:
            self.calibrator.observe(tree.probs, result.accepted_nodes)
            expected = self._expected.pop(seq.seq_id, 0.0)
            self.per_request.observe(seq.seq_id, expected, len(result.accepted_nodes))
        return SpecCounters(1, tree.num_drafts, len(result.accepted_nodes), len(appended))


# Drafting pauses at a batch size after IDLE_AFTER sized steps in a row kept no draft there, if it
# costs IDLE_DRAFT_SHARE of a plain step or more, and drafts again one step in IDLE_PROBE_EVERY
# (Speculator._idle_skip): a pause saves only the drafting, a few percent of a step at one request
# on a CPU, and costs the first steps of every repeat that starts while paused.
IDLE_AFTER = 8
IDLE_PROBE_EVERY = 16
IDLE_DRAFT_SHARE = 0.1

# Host-side cost of verifying trees rather than single tokens: per step (mask building) and per
# tree that drafts anything (tree walk, slot bookkeeping, drafter feedback).
TREE_STEP_OVERHEAD_S = 5e-4
PER_TREE_OVERHEAD_S = 3e-4


def host_overhead(num_trees: int) -> float:
    """Host-side seconds of a step that verifies `num_trees` drafting trees (0 if none)."""
    return TREE_STEP_OVERHEAD_S + PER_TREE_OVERHEAD_S * num_trees if num_trees else 0.0


def choose_draft_sizes(probs: list[list[float]], base_tokens: int, cost: VerifyCost,
                       penalty: float = 1.0, base_scale: float = 1.0) -> list[int]:
    """Draft nodes to keep per tree, maximising expected emitted tokens per second of step time.

    `probs[t][i]` is node i's estimated chance of being accepted (root first), so keeping the m
    most likely nodes over the whole batch yields 1 + sum(p) tokens per decoding sequence. Nodes
    are taken best-first across trees (each tree's nodes are already best-first, so every tree
    keeps a prefix). `base_scale` and `penalty` (learned from observed step times) correct the
    curve's plain step time and its extra time for drafting.
    """
    drafts = np.fromiter((len(tree) - 1 for tree in probs), np.int64, len(probs))
    p = np.array([x for tree in probs for x in tree[1:]], np.float64)
    return draft_sizes(p, np.repeat(np.arange(len(probs)), drafts), len(probs), base_tokens,
                       cost, penalty, base_scale)


def draft_sizes(p: np.ndarray, tree_of: np.ndarray, num: int, base_tokens: int,
                cost: VerifyCost, penalty: float = 1.0, base_scale: float = 1.0) -> list[int]:
    """`choose_draft_sizes` on the batch's drafts flattened in (tree, node) order: p[j] the
    estimate of draft j, tree_of[j] its tree (of `num`).

    Every m is scored at once in numpy (a Python loop over a large batch's drafts costs a
    visible share of its step); tests/oracles/sizing.py is that loop, which this matches
    decision for decision: the same float operations in the same order.
    """
    base_cost = cost(base_tokens)
    plain = base_scale * base_cost
    total = len(p)
    if total == 0:
        return [0] * num
    # Best first; a stable sort keeps ties in (tree, node) order, as sorting (-p, t, i) would.
    order = np.argsort(-p, kind="stable")
    p, tree_of = p[order], tree_of[order]
    expected = np.cumsum(np.concatenate(([float(num)], p)))[1:]  # after each node m = 1..
    first = np.zeros(total, np.int64)
    first[np.unique(tree_of, return_index=True)[1]] = 1
    drafting = np.cumsum(first)  # trees drafting anything among the first m nodes
    host = TREE_STEP_OVERHEAD_S + PER_TREE_OVERHEAD_S * drafting  # host_overhead, m >= 1
    extra = cost.many(base_tokens + np.arange(1, total + 1)) - base_cost + host
    rate = expected / (plain + penalty * extra)
    best = int(np.argmax(rate))  # the first of the best, as a strict > scan would keep
    best_m = best + 1 if rate[best] > num / plain else 0
    return np.bincount(tree_of[:best_m], minlength=num).tolist()


def predicted_step_cost(sizes: list[int], base_tokens: int, cost: VerifyCost) -> float:
    """The curve's step time (host overheads included) for these draft sizes."""
    return cost(base_tokens + sum(sizes)) + host_overhead(sum(1 for k in sizes if k))
