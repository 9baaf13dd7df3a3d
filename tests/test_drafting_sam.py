"""Suffix automaton: counts, recency, matching and separators against brute force."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.drafting.index.sam import ROOT, SEPARATOR, SuffixAutomaton
from ngramspec.drafting.kernels import layout as sk
from ngramspec.drafting.kernels import native

docs_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=25), min_size=1, max_size=3
)


def build(docs: list[list[int]]) -> tuple[SuffixAutomaton, list[int]]:
    sam = SuffixAutomaton()
    for doc in docs:
        sam.add_document(doc)
    sam.finalize()
    stream: list[int] = []
    for doc in docs:
        if stream:
            stream.append(SEPARATOR)
        stream.extend(doc)
    return sam, stream


def naive_count(stream: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(stream[i : i + n] == pattern for i in range(len(stream) - n + 1))


def naive_last_end(stream: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    ends = [i + n - 1 for i in range(len(stream) - n + 1) if stream[i : i + n] == pattern]
    return max(ends)


def walk(sam: SuffixAutomaton, pattern: list[int]) -> int:
    state = ROOT
    for token in pattern:
        state = sam.transition(state, token)
        if state < 0:
            return -1
    return state


@settings(max_examples=60, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=5))
def test_occ_counts_equal_naive_substring_counts(docs, pattern):
    sam, stream = build(docs)
    state = walk(sam, pattern)
    count = naive_count(stream, pattern)
    assert (state >= 0) == (count > 0)
    if state >= 0:
        assert sam.occ(state) == count
        assert sam.max_end_pos(state) == naive_last_end(stream, pattern)


@settings(max_examples=40, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=0, max_size=4))
def test_children_lists_are_sorted_and_exact(docs, pattern):
    sam, stream = build(docs)
    state = walk(sam, pattern)
    if state < 0:
        return
    by_freq = sam.children_by_freq(state)
    expected = {}
    for t in set(stream) - {SEPARATOR}:
        c = naive_count(stream, pattern + [t])
        if c:
            expected[t] = c
    assert {t: c for t, _, c in by_freq} == expected
    assert [(-c, t) for t, _, c in by_freq] == sorted((-c, t) for t, _, c in by_freq)
    by_rec = sam.children_by_recency(state)
    assert {t: p for t, _, p in by_rec} == {
        t: naive_last_end(stream, pattern + [t]) for t in expected
    }
    assert [(-p, t) for t, _, p in by_rec] == sorted((-p, t) for t, _, p in by_rec)


@settings(max_examples=40, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 8))
def test_match_finds_longest_suffix_then_links(docs, context, max_len):
    sam, stream = build(docs)
    anchors = sam.match(context, max_len)
    window = context[-max_len:]
    longest = max(
        (k for k in range(len(window) + 1) if k == 0 or naive_count(stream, window[-k:]) > 0)
    )
    lengths = [k for _, k in anchors]
    assert lengths == sorted(lengths, reverse=True)
    assert len(set(s for s, _ in anchors)) == len(anchors)
    for state, k in anchors:
        suffix = window[len(window) - k :]
        assert walk(sam, suffix) == state
        assert sam.num_children(state) >= 1
    # Every suffix length with a continuation is covered by some anchor's state.
    covered = {k for _, k in anchors}
    for k in range(1, longest + 1):
        state = walk(sam, window[-k:])
        if sam.num_children(state):
            assert any(s == state for s, _ in anchors)
    if anchors and sam.num_children(walk(sam, window[len(window) - longest :])):
        assert max(covered) == longest


@settings(max_examples=40, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 8))
def test_streaming_advance_equals_stateless_match(docs, context, max_len):
    sam, _ = build(docs)
    state, length = ROOT, 0
    for i, token in enumerate(context):
        state, length = sam.advance(state, length, token, max_len)
        assert (state, length) == sam.match_state(context[: i + 1], max_len)


@settings(max_examples=40, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_no_continuation_crosses_a_separator(docs, context):
    sam, stream = build(docs)
    for state, _ in sam.match(context, 8):
        frontier = [(state, [])]
        while frontier:  # every path from an anchor stays inside one document
            node, path = frontier.pop()
            for token, child, _ in sam.children_by_freq(node):
                assert token != SEPARATOR
                if len(path) < 4:
                    frontier.append((child, path + [token]))
    assert sam.transition(ROOT, SEPARATOR) == -1


def test_documents_do_not_join():
    sam = SuffixAutomaton()
    sam.add_document([1, 2, 3])
    sam.add_document([4, 5])
    sam.finalize()
    assert walk(sam, [3, 4]) == -1  # "3 4" spans the boundary
    state = walk(sam, [3])
    assert sam.children_by_freq(state) == []
    assert sam.match([9, 3], 4) == []  # "3" has no continuation: not an anchor
    assert sam.num_tokens == 6  # separator counted, as in SGLang's tokenCount


def test_recency_prefers_latest_occurrence():
    sam = SuffixAutomaton()
    sam.extend([7, 1, 7, 2, 7, 2, 7, 3])
    sam.finalize()
    state = walk(sam, [7])
    assert [t for t, _, _ in sam.children_by_recency(state)] == [3, 2, 1]
    assert [t for t, _, _ in sam.children_by_freq(state)] == [2, 1, 3]


def test_empty_corpus_is_an_error():
    sam = SuffixAutomaton()
    with pytest.raises(ValueError, match="empty"):
        sam.finalize()
    sam.extend([SEPARATOR])
    with pytest.raises(ValueError, match="empty"):
        sam.finalize()


def test_extend_after_finalize_is_refused():
    sam = SuffixAutomaton()
    sam.extend([1, 2])
    sam.finalize()
    with pytest.raises(RuntimeError):
        sam.extend([3])


@settings(max_examples=20, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_arrays_round_trip(docs, context):
    sam, _ = build(docs)
    meta, arrays = sam.to_arrays()
    again = SuffixAutomaton.from_arrays(dict(meta), {k: np.copy(v) for k, v in arrays.items()})
    assert again.num_tokens == sam.num_tokens
    assert again.match(context, 6) == sam.match(context, 6)
    for state, _ in sam.match(context, 6):
        assert again.children_by_freq(state) == sam.children_by_freq(state)
        assert again.children_by_recency(state) == sam.children_by_recency(state)


def test_from_arrays_rejects_bad_input():
    sam, _ = build([[1, 2, 3]])
    meta, arrays = sam.to_arrays()
    with pytest.raises(ValueError):
        SuffixAutomaton.from_arrays({**meta, "version": 99}, arrays)
    with pytest.raises(ValueError):
        SuffixAutomaton.from_arrays(meta, {k: v for k, v in arrays.items() if k != "occ"})


def test_builds_200k_tokens_quickly():
    rng = np.random.default_rng(0)
    # Repetitive text (the realistic case) from a small vocabulary of phrases.
    phrases = [rng.integers(0, 500, size=rng.integers(3, 12)).tolist() for _ in range(300)]
    stream: list[int] = []
    while len(stream) < 200_000:
        stream.extend(phrases[int(rng.integers(0, 300))])
    start = time.perf_counter()
    sam = SuffixAutomaton()
    sam.extend(stream)
    sam.finalize()
    elapsed = time.perf_counter() - start
    assert sam.num_states <= 2 * len(stream)
    assert elapsed < 15.0  # ~5 µs/token in pure Python on a loaded 2-core box


def _reference_catch_up(sams, roots, match, tok, lo, n, cap) -> None:
    """The oracle of a request's walks: feed each corpus's match tok[fed:n] with the Python
    automaton's `advance` (from the root over the last `cap` tokens from `lo` on when marked
    -1); the bank numbers corpus k's states from roots[k] instead of ROOT."""
    for k, sam in enumerate(sams):
        base = int(roots[k]) - ROOT
        fed = int(match[k, sk.M_FED])
        if fed < 0:
            state, length, fed = ROOT, 0, max(lo, n - cap)
        else:
            state, length = int(match[k, sk.M_STATE]) - base, int(match[k, sk.M_LEN])
        for i in range(fed, n):
            state, length = sam.advance(state, length, int(tok[i]), cap)
        match[k] = (state + base, length, n)


@given(st.lists(docs_strategy, min_size=1, max_size=3),
       st.lists(st.lists(st.sampled_from([0, 1, 2, 3, SEPARATOR]), min_size=12, max_size=12),
                min_size=1, max_size=5),
       st.integers(1, 6), st.data())
@settings(max_examples=150, deadline=None)
def test_interleaved_catch_up_equals_advance(corpora, toks, cap, data):
    """The prefetching walks of a batch (drafter.cpp `run_walks`) end where the automaton's
    `advance` does, from fresh (-1) and part-fed matches, across separators and the length
    clamp."""
    sams = [build(docs)[0] for docs in corpora]
    bank = sk.CorpusBank(sams)
    toks = np.array(toks, np.int32)
    num = len(toks)
    los = [data.draw(st.integers(0, 4)) for _ in range(num)]
    matches = np.stack([bank.new_matches() for _ in range(num)])
    for i in range(num):  # some walks part-fed already
        fed = data.draw(st.integers(0, 11))
        if fed:
            _reference_catch_up(sams, bank.roots, matches[i], toks[i], los[i], max(fed, los[i]),
                                cap)
    want = matches.copy()
    for i in range(num):
        _reference_catch_up(sams, bank.roots, want[i], toks[i], los[i], toks.shape[1], cap)
    native().catch_up(bank.states, bank.trans, bank.edges, bank.roots, matches, toks,
                      np.array(los, np.int64), cap)
    assert matches.tolist() == want.tolist()
