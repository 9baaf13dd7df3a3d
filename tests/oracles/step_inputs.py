"""A step's visible-slot lists built token by token (the reference for engine/step_inputs.py,
which builds a step's tree lists with whole-array operations)."""

from __future__ import annotations

from ngramspec.engine.step_inputs import ForwardItem


def reference_local_lists(items: list[ForwardItem]) -> tuple[list[int], list[int]]:
    """Every token's visible query-token slots, concatenated, and their offsets: a tree token
    sees its parent's list, then itself; a masked token the slots its row marks; a causal
    token nothing (its lists are implied)."""
    local: list[int] = []
    local_offsets = [0]
    for it in items:
        if it.parents is not None:
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
    return local, local_offsets
