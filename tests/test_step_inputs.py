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
        kind = draw(st.sampled_from(["causal", "tree", "mask"] if masks else ["causal", "tree"]))
        n = draw(st.integers(1 if kind == "tree" else 0, 9))  # a tree has at least its root
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
                               [n - 1] if n else [], parents=parents))
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
    unpaged = flatten(step, paged=False)  # the SDPA backend reads the items instead
    assert unpaged.local.tolist() == [] and unpaged.local_offsets.tolist() == [0]
    assert unpaged.token_ids == flat.token_ids and unpaged.logit_rows == flat.logit_rows


def test_a_tree_flattens_to_its_ancestors_lists():
    tree = ForwardItem([5, 6, 7], [3, 4, 4], [1, 2], [3, 4, 5], None, [0, 1, 2],
                       parents=[-1, 0, 0])
    flat = flatten([tree])
    assert flat.local.tolist() == [3, 3, 4, 3, 5]
    assert flat.local_offsets.tolist() == [0, 1, 3, 5]


@pytest.mark.parametrize("parents, slots, error", [
    ([-1, 2, 0], [3, 4, 5], "parent must come before"),
    ([-1, -2, 0], [3, 4, 5], "must be -1 .the root. or a node index"),
    ([-1, 0], [3, 4, 5], "2 parents for 3 tokens"),
    ([-1, 0, 0], [3, 4], "2 slots for 3 query tokens"),
])
def test_a_malformed_tree_is_a_clear_error(parents, slots, error):
    bad = ForwardItem([5, 6, 7], [3, 4, 4], [], slots, None, [0], parents=parents)
    with pytest.raises(ValueError, match=error):
        flatten([bad])
