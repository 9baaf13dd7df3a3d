"""Per-request context index: all earlier occurrences of the suffix, never across separators."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.context import ReferenceContextIndex

from ngramspec.drafting.index.context import ContextIndex
from ngramspec.drafting.index.sam import SEPARATOR

# Every test runs on the pure-Python reference and on the native index (same results).
backends = pytest.mark.parametrize("index_cls", [ReferenceContextIndex, ContextIndex],
                                   ids=["python", "native"])
tokens_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=40)


def build(index_cls: type, refs: list[list[int]], stream: list[int], max_match: int,
          k: int) -> ReferenceContextIndex | ContextIndex:
    index = index_cls(max_match, k)
    for doc in refs:
        index.add_document(doc)
    index.extend(stream)
    return index


def brute_occurrences(tokens: list[int], m: int) -> list[int]:
    """End positions (before the last token) of earlier windows equal to the last m tokens."""
    n = len(tokens)
    suffix = tokens[n - m :]
    if SEPARATOR in suffix:
        return []
    return [e for e in range(m - 1, n - 1) if tokens[e - m + 1 : e + 1] == suffix]


@backends
@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=2), tokens_strategy,
       st.integers(1, 6), st.integers(1, 5))
def test_anchors_match_brute_force(index_cls, refs, stream, max_match, k):
    index = build(index_cls, refs, stream, max_match, k)
    tokens = list(index.tokens)
    anchors = index.anchors(max_anchors=100)
    expected, last = [], 0
    for m in range(min(max_match, len(stream)), 0, -1):
        occ = brute_occurrences(tokens, m)
        if len(occ) > last:
            expected.append((m, occ[-k:]))
            last = len(occ)
            if last >= k:
                break
    assert anchors == expected


@backends
@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=2), tokens_strategy,
       st.integers(1, 6), st.integers(1, 5), st.data())
def test_anchors_at_an_earlier_position_match_brute_force(index_cls, refs, stream, max_match,
                                                          k, data):
    """A wildcard match looks up the suffix ending before the last tokens: the same anchors as
    if the index ended there (the native index walks `prev` chains, the reference scans)."""
    index = build(index_cls, refs, stream, max_match, k)
    tokens = list(index.tokens)
    end = data.draw(st.integers(-1, len(tokens) - 1))
    expected, last = [], 0
    for m in range(min(max_match, end + 1), 0, -1):
        occ = brute_occurrences(tokens[:end + 1], m)
        if len(occ) > last:
            expected.append((m, occ[-k:]))
            last = len(occ)
            if last >= k:
                break
    assert index.anchors_at(end, max_anchors=100) == expected
    assert index.anchors_at(len(tokens) - 1, 3) == index.anchors(3)


@backends
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=10), max_size=2), tokens_strategy)
def test_continuation_walk_groups_by_token_and_stops_at_separators(index_cls, refs, stream):
    """Walk continuations as the drafter does (a group's ends go one offset deeper)."""
    index = build(index_cls, refs, stream, 4, 50)
    for m, ends in index.anchors(10):
        frontier = [(ends, 0)]
        while frontier:
            ends_now, offset = frontier.pop()
            groups = index.continuations(ends_now, offset)
            for token, group in groups.items():
                assert token != SEPARATOR
                for end in group:
                    assert int(index.tokens[end + offset + 1]) == token
                    # the copied span (match + continuation) lies inside one document
                    assert SEPARATOR not in list(index.tokens[end - m + 1 : end + offset + 2])
                if offset < 5:
                    frontier.append((group, offset + 1))
            grouped = sorted(e for g in groups.values() for e in g)
            valid = [e for e in ends_now if e + offset + 1 < len(index.tokens)
                     and index.tokens[e + offset + 1] != SEPARATOR]
            assert grouped == sorted(valid)


@backends
def test_prompt_copy_on_first_step(index_cls):
    index = build(index_cls, [], [5, 1, 2, 3, 4, 6, 1, 2], 8, 8)
    (m, ends), *_ = index.anchors(3)
    assert m == 2 and ends == [2]  # "1 2" ended at position 2
    assert index.continuations(ends, 0) == {3: [2]}
    assert index.continuations(ends, 1) == {4: [2]}


@backends
def test_reference_documents_do_not_join_the_prompt(index_cls):
    index = build(index_cls, [[7, 8]], [8, 9, 7], 4, 8)
    # Text: 7 8 SEP 8 9 7. Suffix "7" occurred at 0, continuing with 8 (inside the reference).
    assert index.anchors(3) == [(1, [0])]
    assert index.continuations([0], 0) == {8: [0]}
    assert index.continuations([0], 1) == {}  # next is the separator
