"""A step's forward inputs: each sequence's share (ForwardItem), and all of them flattened into the
lists the model and the paged attention kernels read (FlatStep), on the host."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ngramspec.drafting.kernels import native
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
    slots: np.ndarray  # [T] int64: cache slot written by each query token
    logit_rows: list[int]  # [R] flat rows whose logits are returned, in order
    seq_offsets: list[int]  # [B + 1]
    prefixes: list[list[int]]  # each item's cached slots (the items' own lists, not copies)
    prefix_offsets: list[int]  # [B + 1]
    local: np.ndarray  # [N] int64: tree tokens' visible query-token slots
    local_offsets: np.ndarray  # [T + 1] int64 (empty ranges for causal items' tokens)
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
    seq_offsets, prefix_offsets = [0], [0]
    prefixes: list[list[int]] = []
    causal: list[int] = []
    parents: list[int] = []  # every tree's parents, concatenated
    tree_starts: list[int] = []  # [B] where each item's parents begin there, -1 if not a tree
    masks = False
    for it in items:
        base = len(ids)
        rows += [base + r for r in it.logits_rows]
        ids += it.token_ids
        positions += it.positions
        slots += it.slots
        if not paged:
            continue
        seq_offsets.append(len(ids))
        prefixes.append(it.prefix_slots)
        prefix_offsets.append(prefix_offsets[-1] + len(it.prefix_slots))
        causal.append(int(it.causal))
        if it.parents is None:
            tree_starts.append(-1)
            masks = masks or it.local_mask is not None
            continue
        if len(it.parents) != len(it.token_ids):
            raise ValueError(f"a tree item has {len(it.parents)} parents for "
                             f"{len(it.token_ids)} tokens")
        tree_starts.append(len(parents))
        parents += it.parents
    if len(slots) != len(ids):  # the kernel reads a slot per token, unchecked
        raise ValueError(f"the items have {len(slots)} slots for {len(ids)} query tokens")
    slot_array = np.array(slots, np.int64)
    if not paged:
        local, local_offsets = np.zeros(0, np.int64), np.zeros(1, np.int64)
    elif masks:  # only tests build items with an explicit mask
        local, local_offsets = _mask_lists(items)
    elif parents:
        local, local_offsets = tree_lists(np.array(parents, np.int64),
                                          np.array(tree_starts, np.int64),
                                          np.array(seq_offsets, np.int64), slot_array)
    else:
        local, local_offsets = np.zeros(0, np.int64), np.zeros(len(ids) + 1, np.int64)
    return FlatStep(ids, positions, slot_array, rows, seq_offsets, prefixes, prefix_offsets,
                    local, local_offsets, causal,
                    max((len(it.token_ids) for it in items), default=1))


def tree_lists(parents: np.ndarray, tree_starts: np.ndarray, seq_offsets: np.ndarray,
               slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every token's visible query-token slots, concatenated, and their offsets ([T + 1]): a tree
    token's list is its parent's, then its own slot; a token of an item that is not a tree has
    none. Item b's tokens are seq_offsets[b] .. seq_offsets[b + 1] - 1 ([B + 1]); a tree's
    parents are parents[tree_starts[b]:] (-1 for the root, else an index within the tree before
    the node's own), tree_starts[b] -1 for other items. Native (drafting/kernels/drafter.cpp):
    a Python loop over a large batch's nodes costs a visible share of a step."""
    offsets = np.empty(slots.shape[0] + 1, np.int64)
    local = native().tree_lists(parents, tree_starts, seq_offsets, slots, offsets)
    return np.frombuffer(local, np.int64), offsets


def _mask_lists(items: list[ForwardItem]) -> tuple[np.ndarray, np.ndarray]:
    """Every token's visible query-token slots row by row from each item's mask (a tree's is
    its ancestor mask; a causal item's rows are empty)."""
    local: list[int] = []
    local_offsets = [0]
    for it in items:
        for row in it.mask() or [[]] * len(it.token_ids):
            local += [s for s, seen in zip(it.slots, row) if seen]
            local_offsets.append(len(local))
    return np.array(local, np.int64), np.array(local_offsets, np.int64)
