"""A step's forward inputs: each sequence's share (ForwardItem), and all of them flattened into the
lists the model and the paged attention kernels read (FlatStep), on the host."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ngramspec.drafting.tree import ancestor_mask
from ngramspec.engine.kv_cache import SlotList


@dataclass(slots=True)
class ForwardItem:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # [n] query tokens
    positions: list[int]  # [n]
    prefix_slots: list[int]  # K/V slots already cached, attended by every query token
    slots: list[int]  # [n] where the query tokens' K/V are written
    local_mask: list[list[bool]] | None  # [n, n] mask among query tokens; None = causal
    logits_rows: list[int]  # query rows whose logits are needed
    # instead of local_mask, a tree as parent indices (-1 for the root, each parent before its
    # child): row i sees its ancestors and itself. Cheaper to flatten than a mask.
    parents: list[int] | None = None

    @property
    def causal(self) -> bool:
        return self.local_mask is None and self.parents is None

    def mask(self) -> list[list[bool]] | None:
        """The [n, n] mask among query tokens (None = causal)."""
        return self.local_mask if self.parents is None else ancestor_mask(self.parents)


@dataclass(slots=True)
class FlatStep:
    """Every item of a step, concatenated in order (the fields of layers/attention.py's
    PagedMetadata, as host lists)."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T] cache slot written by each query token
    logit_rows: list[int]  # [R] flat rows whose logits are returned, in order
    seq_offsets: list[int]  # [B + 1]
    prefixes: list[list[int]]  # each item's cached slots (the items' own lists, not copies)
    prefix_offsets: list[int]  # [B + 1]
    local: list[int]  # [N] tree tokens' visible query-token slots
    local_offsets: list[int]  # [T + 1] (empty ranges for causal items' tokens)
    causal: list[int]  # [B] 1 = causal item
    max_query_len: int  # the most query tokens of one item

    @property
    def num_prefix(self) -> int:
        return self.prefix_offsets[-1]

    def prefix(self) -> np.ndarray:
        """[P] int64: every item's cached slots, concatenated: from the sequences' slot buffers
        (engine/kv_cache.py SlotList) when every item has one, else read from the lists."""
        if self.prefixes and all(isinstance(p, SlotList) for p in self.prefixes):
            return np.concatenate([p.array() for p in self.prefixes])
        return np.fromiter(itertools.chain.from_iterable(self.prefixes), np.int64,
                           count=self.num_prefix)


def flatten(items: list[ForwardItem], paged: bool = True) -> FlatStep:
    """The step's lists. Each item's prefix slots and, for a tree, each token's visible query-token
    slots in position order (its ancestors and itself, which precede it in the tree's best-first
    order); a causal item's lists are implied (token i sees the item's slots 0..i). `paged=False`
    (the SDPA backend, which reads the items) leaves the attention lists empty."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    seq_offsets, prefix_offsets, local_offsets = [0], [0], [0]
    prefixes: list[list[int]] = []
    local: list[int] = []
    causal: list[int] = []
    for it in items:
        rows += [len(ids) + r for r in it.logits_rows]
        ids += it.token_ids
        positions += it.positions
        slots += it.slots
        if not paged:
            continue
        seq_offsets.append(len(ids))
        prefixes.append(it.prefix_slots)
        prefix_offsets.append(prefix_offsets[-1] + len(it.prefix_slots))
        causal.append(int(it.causal))
        if it.parents is not None:  # a token sees its parent's list, then itself
            seen_by: list[list[int]] = []
            for parent, slot in zip(it.parents, it.slots):
                own = (seen_by[parent] if parent >= 0 else []) + [slot]
                seen_by.append(own)
                local += own
                local_offsets.append(len(local))
            continue
        for row in it.local_mask or [[]] * len(it.token_ids):
            local += [s for s, seen in zip(it.slots, row) if seen]
            local_offsets.append(len(local))
    return FlatStep(ids, positions, slots, rows, seq_offsets, prefixes, prefix_offsets, local,
                    local_offsets, causal, max((len(it.token_ids) for it in items), default=1))
