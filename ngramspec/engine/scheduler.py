"""Continuous batching: FCFS admission, chunked prefill, token and sequence limits, preemption.

The scheduler is the one owner of KV slots: it allocates them (prefill chunks, decode roots,
draft trees, scratch space), commits a step's slots to its sequence, and frees them on trim,
failure, preemption and finish. Nothing else calls the allocator. With prefix caching, a
finished (or fully prefilled) sequence's committed slots pass to the prefix cache, an index the
scheduler consults at admission and evicts from when it needs slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ngramspec.engine.kv_cache import SlotAllocator, SlotList
from ngramspec.engine.prefix_cache import PrefixCache
from ngramspec.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index computed in this step
    slots: list[int]  # fresh KV slots for this step's query tokens (root first for decodes)

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    @property
    def is_prefill(self) -> bool:
        return self.start < self.seq.num_tokens - 1

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so it yields the next one."""
        return self.start + len(self.slots) >= self.seq.num_tokens


@dataclass(slots=True)
class Schedule:
    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    spare_tokens: int  # token budget left for draft nodes

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def base_tokens(self) -> int:
        """Query tokens before any draft: one a decode, a prefill's chunk."""
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, num_slots: int, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_reserve: int = 16, prefix_cache: bool = False) -> None:
        self.allocator = SlotAllocator(num_slots)  # read its counts elsewhere; never allocate
        self.cache = PrefixCache() if prefix_cache else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Slots a new request must leave free so running requests can keep decoding.
        self.admission_reserve = admission_reserve
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            scheduled.add(seq.seq_id)
            if seq.is_decoding:
                slots = self._allocate_or_preempt(seq, 1, scheduled)
                if slots is not None:
                    decodes.append(ScheduledChunk(seq, seq.num_tokens - 1, slots))
                    budget -= 1
            else:
                chunk = self._prefill_chunk(seq, budget)
                if chunk is not None:
                    prefills.append(chunk)
                    budget -= chunk.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.num_tokens + self.admission_reserve
            if need > self.num_available and self.running:
                break  # FCFS: later requests never overtake the head of the queue
            if not seq.slots:
                self._reuse_prefix(seq)
            chunk = self._prefill_chunk(seq, budget)
            if chunk is None:
                self._drop_slots(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(chunk)
            budget -= chunk.num_tokens
        return Schedule(decodes, prefills, budget)

    @property
    def num_available(self) -> int:
        """Slots free now or once the prefix cache gives back what no request uses."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    def _allocate(self, n: int) -> list[int] | None:
        """n free slots, evicting cached prefixes nobody uses if needed; None if impossible."""
        if n > self.allocator.num_free and self.cache is not None:
            self.allocator.free(self.cache.evict(n - self.allocator.num_free))
        return self.allocator.allocate(n)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start `seq` from the longest cached prefix of its tokens (at least its last token is
        computed: it yields the next one). Prompt logprobs need every prompt row: no reuse."""
        if not self._caches(seq):
            return
        seq.cache_node, slots = self.cache.match(seq.token_ids[: seq.num_tokens - 1])
        seq.slots = SlotList(slots)
        seq.num_shared = len(seq.slots)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        n = min(seq.num_tokens - seq.num_cached, budget)
        slots = self._allocate(n)
        if not slots:
            return None
        return ScheduledChunk(seq, seq.num_cached, slots)

    def _allocate_or_preempt(self, seq: Sequence, n: int, scheduled: set[int]) -> list[int] | None:
        # Victims are the latest arrivals not yet in this step; failing that, `seq` itself.
        while (slots := self._allocate(n)) is None:
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:
                self.preempt(seq)
                return None
            self.preempt(victim)
        return slots

    # ------------------------------------------------------------------ a step's slots

    def reserve_tree(self, chunk: ScheduledChunk, num_drafts: int) -> bool:
        """Slots for a decode's draft nodes, after its root's; False (nothing taken) when the
        cache is too full to speculate this step."""
        slots = self._allocate(num_drafts)
        if slots is None:
            return False
        chunk.slots.extend(slots)
        return True

    def commit(self, chunk: ScheduledChunk, keep: list[int] | None = None) -> None:
        """The chunk's K/V become the sequence's next positions: all of them, or only the chunk
        slots at `keep` (a tree's root and accepted path, in order); the others are freed.

        Slots are token-granular, so committing is a slot-table rewrite: accepted node i at depth
        k was written at position start + k, exactly where it now belongs.
        """
        seq = chunk.seq
        if keep is None:
            seq.slots += chunk.slots
            if chunk.is_prefill and chunk.samples:  # the prompt is in: others may share it
                self._cache_slots(seq)
            return
        seq.slots += [chunk.slots[i] for i in keep]
        kept = set(keep)
        self.allocator.free([s for i, s in enumerate(chunk.slots) if i not in kept])

    def release(self, chunk: ScheduledChunk) -> None:
        """Free a chunk's slots without committing them (its step failed)."""
        self.allocator.free(chunk.slots)
        chunk.slots = []

    def trim(self, seq: Sequence) -> None:
        """Free the K/V of tokens computed past a stop: they were never appended."""
        extra = len(seq.slots) - (seq.num_tokens - 1)
        assert extra <= len(seq.slots) - seq.num_shared, "trimming into the shared prefix"
        if extra > 0:
            self.allocator.free(seq.slots[-extra:])
            del seq.slots[-extra:]

    @contextmanager
    def scratch_slots(self, n: int) -> Iterator[list[int]]:
        """n slots for a forward pass outside any request (cost timing, tests), freed after."""
        slots = self._allocate(n)
        if slots is None:
            raise ValueError(f"not enough free KV slots ({self.allocator.num_free}) for {n}")
        try:
            yield slots
        finally:
            self.allocator.free(slots)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's K/V and requeue it at the front; it is recomputed later, intact
        (from whatever prefix the cache still holds then: its K/V go to the cache as the least
        likely to be evicted, since they were used last)."""
        self._cache_slots(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Give up the K/V and wait at the front of the queue (the tokens stay)."""
        self._drop_slots(seq)
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reusable: bool = True) -> None:
        """End `seq`; its committed K/V go to the prefix cache unless not `reusable` (its step
        failed, so its numbers are suspect)."""
        if reusable:
            self._cache_slots(seq)
        self._drop_slots(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # ------------------------------------------------------------------ the prefix cache

    def _cache_slots(self, seq: Sequence) -> None:
        """Hand the sequence's committed slots past its shared prefix to the cache."""
        if not self._caches(seq):
            return
        node = seq.cache_node or self.cache.root
        first = seq.num_shared
        seq.cache_node, taken = self.cache.insert(
            node, seq.token_ids[first : len(seq.slots)], seq.slots[first:])
        seq.num_shared += taken

    def _caches(self, seq: Sequence) -> bool:
        """Whether `seq` shares through the cache (prompt logprobs need every prompt row)."""
        return self.cache is not None and seq.params.prompt_logprobs is None

    def _drop_slots(self, seq: Sequence) -> None:
        """Free the sequence's own slots and unlock its shared prefix."""
        self.allocator.free(seq.slots[seq.num_shared:])
        if self.cache is not None and seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        seq.slots, seq.cache_node, seq.num_shared = SlotList(), None, 0

    def recompute_all(self) -> None:
        """Every running request gives up its K/V (not cached: it is about to be stale) and
        waits, in its order, ahead of the queue; its tokens stay and are recomputed."""
        for seq in reversed(list(self.running)):
            self._requeue(seq)

    def flush_cache(self) -> int:
        """Evict every cached prefix no running request uses; how many slots were freed."""
        if self.cache is None:
            return 0
        freed = self.cache.clear()
        self.allocator.free(freed)
        return len(freed)
