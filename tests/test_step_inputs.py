"""engine/step_inputs.py: a step's flattened lists against a token-by-token reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.engine.step_inputs import ForwardItem, flatten
from tests.oracles.step_inputs import reference_local_lists


@st.composite
def items(draw: st.DrawFn, masks: bool) -> list[ForwardItem]:
    """A step's items: causal chunks, trees given by parents and (with `masks`) items with an
    explicit mask, on distinct slots."""
    out: list[ForwardItem] = []
    slot = 1
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.integers(1, 9))
        kind = draw(st.sampled_from(["causal", "tree", "mask"] if masks else ["causal", "tree"]))
        parents = None
        if kind == "tree":
            parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        mask = None
        if kind == "mask":
            mask = [[draw(st.booleans()) for _ in range(n)] for _ in range(n)]
        prefix = list(range(slot, slot + draw(st.integers(0, 3))))
        slot += len(prefix)
        own = list(range(slot, slot + n))
        slot += n
        out.append(ForwardItem(list(range(100, 100 + n)), list(range(n)), prefix, own, mask,
                               [n - 1], parents=parents))
    return out


@settings(max_examples=300, deadline=None)
@given(step=st.one_of(items(masks=False), items(masks=True)))
def test_flatten_lists_equal_the_token_by_token_reference(step):
    flat = flatten(step)
    local, local_offsets = reference_local_lists(step)
    assert list(flat.local) == local
    assert list(flat.local_offsets) == local_offsets
    assert flat.token_ids == [t for it in step for t in it.token_ids]
    assert flat.slots.tolist() == [s for it in step for s in it.slots]
    assert flat.causal == [int(it.causal) for it in step]
    assert len(flat.local_offsets) == len(flat.token_ids) + 1


def test_a_step_without_paged_lists_leaves_them_empty():
    tree = ForwardItem([5, 6, 7], [3, 4, 4], [1, 2], [3, 4, 5], None, [0, 1, 2],
                       parents=[-1, 0, 0])
    flat = flatten([tree], paged=False)
    assert list(flat.local) == [] and list(flat.local_offsets) == [0]
    assert flatten([tree]).local.tolist() == [3, 3, 4, 3, 5]


def test_a_parent_after_its_node_is_a_clear_error():
    bad = ForwardItem([5, 6, 7], [3, 4, 4], [], [3, 4, 5], None, [0], parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="parent must come before"):
        flatten([bad])
