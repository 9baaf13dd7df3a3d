"""Speculator: the engine's side of n-gram speculation: it asks the drafter for trees, sizes them
with the policy (policy/: the drafter's calibrated estimates against the step cost), and feeds
commits to the drafter and step times to the cost. It holds no KV slots and no engine state:
trees go back to the engine, counters go back as values."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.protocol import Drafter
from ngramspec.drafting.tree import DraftBatch, DraftTree
from ngramspec.engine.scheduler import Schedule, ScheduledChunk
from ngramspec.engine.sequence import Sequence, SpecCounters
from ngramspec.engine.verify import VerifyResult
from ngramspec.policy.cost import StepCost, VerifyCost, batch_bucket
from ngramspec.policy.sizing import may_pay, size_trees, step_extras


class Speculator:
    def __init__(self, config: DrafterConfig, drafter: Drafter, cost: VerifyCost | None,
                 learn_step_times: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        """`cost` is the verify-cost curve trees are sized by; None verifies every tree whole (the
        SGLang way). `learn_step_times` corrects that curve from observed step times, which only
        makes sense when it was measured here rather than given. `clock` times the drafting."""
        self.config = config
        self.drafter = drafter
        self.cost = StepCost(cost, learn_step_times) if cost is not None else None
        # this step's curve time, its drafts' extra and their host guess (StepCost.observe)
        self._predicted: tuple[float, float, float] | None = None
        # per batch-size bucket: sized steps in a row that kept no draft (see BACKOFF_AFTER), and
        # a full drafting call's seconds (average)
        self._idle: dict[int, int] = {}
        self._draft_seconds: dict[int, float] = {}
        self.clock = clock

    def restart_calibration(self) -> None:
        """New weights: what was learned about acceptance and step times no longer holds (the
        drafter's n-gram statistics, which are model-free, stay)."""
        reset = getattr(self.drafter, "reset_calibration", None)  # optional in the protocol
        if reset is not None:
            reset()
        self._idle.clear()
        if self.cost is not None:
            self.cost.reset()

    def start(self, seq: Sequence, references: list[list[int]] | None) -> None:
        self.drafter.start(seq.request_id, seq.token_ids, references)

    def stop(self, seq: Sequence) -> None:
        self.drafter.stop(seq.request_id)

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
        if budget <= 0:
            return {}
        cost, base = self.cost, schedule.base_tokens
        bucket = batch_bucket(len(schedule.decodes))
        if cost is not None and self._backed_off(bucket, base):
            batch, lengths = self._draft(chunks, 1)  # a look at each tree's best node only
            if not may_pay(batch.probs, lengths, len(chunks) * budget, base, cost.curve,
                           cost.prices(len(schedule.decodes))):
                self._predicted = (cost.curve(base), 0.0, 0.0)
                return {}
        batch, lengths = self._draft(chunks, budget, bucket)
        if cost is not None:
            sizes = size_trees(batch.probs, lengths, base, cost, len(schedule.decodes))
            self._idle[bucket] = 0 if any(sizes) else self._idle.get(bucket, 0) + 1
            self._predicted = (cost.curve(base), *step_extras(sizes, base, cost.curve))
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

    def _draft(self, chunks: list[ScheduledChunk], budget: int,
               bucket: int | None = None) -> tuple[DraftBatch, np.ndarray]:
        """The drafter's trees for `chunks` (grammar-constrained) and each one's node count,
        root included, capped at budget + 1; a call's seconds are averaged under `bucket`."""
        start = self.clock()
        trees = self.drafter.propose([c.seq.request_id for c in chunks], [budget] * len(chunks))
        if bucket is not None:
            took = self.clock() - start
            last = self._draft_seconds.get(bucket)
            self._draft_seconds[bucket] = took if last is None else 0.8 * last + 0.2 * took
        # At least budget + 1 columns: a grammar's forced chain may fill all of them.
        batch = DraftBatch.from_trees(trees, budget + 1)
        # Under a grammar: forced tokens first, forbidden nodes out, before anything is sized.
        for i, c in enumerate(chunks):
            if c.seq.grammar is not None:
                batch.replace(i, c.seq.grammar.constrain(batch.tree(i)))
        return batch, np.minimum(batch.sizes, budget + 1)

    def _backed_off(self, bucket: int, base_tokens: int) -> bool:
        """Whether to look at each tree's best node before drafting whole trees: the sized trees
        at this batch size have kept nothing for BACKOFF_AFTER steps in a row, and a drafting
        call costs at least BACKOFF_DRAFT_SHARE of a plain step. The look is cheaper than a full
        call and never keeps the step from drafting: whole trees are drafted as soon as the best
        node could pay."""
        assert self.cost is not None
        if self._idle.get(bucket, 0) < BACKOFF_AFTER:
            return False
        return self._draft_seconds.get(bucket, 0.0) >= BACKOFF_DRAFT_SHARE * self.cost.curve(
            base_tokens)

    def after_step(self, schedule: Schedule, seconds: float) -> None:
        """Feed a decode-only step's time to the step cost (prefill steps are not comparable)."""
        if (self.cost is not None and self._predicted is not None and schedule.decodes
                and not schedule.prefills):
            self.cost.observe(len(schedule.decodes), *self._predicted, seconds)

    def observe(self, seq: Sequence, tree: DraftTree, result: VerifyResult,
                appended: list[int]) -> SpecCounters | None:
        """Learn from one request's verify step; its counters, or None for a prefill's token."""
        self.drafter.commit(seq.request_id, appended)
        if seq.num_tokens - len(appended) <= seq.num_prompt_tokens:
            return None  # the first token comes from prefill, not from a verify step
        return SpecCounters(1, tree.num_drafts, len(result.accepted_nodes), len(appended))


# Drafting looks at each tree's best node only (Speculator._backed_off) at a batch size where
# BACKOFF_AFTER sized steps in a row kept no draft, if a drafting call costs BACKOFF_DRAFT_SHARE of
# a plain step or more; where drafting is cheaper (a CPU at one request) it never backs off.
BACKOFF_AFTER = 8
BACKOFF_DRAFT_SHARE = 0.1
