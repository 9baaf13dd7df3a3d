"""Global trie: count-once n-gram counts, eviction invariants, never-stale anchors, persistence."""

from __future__ import annotations

import sys
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.trie import ROOT, ReferenceTrie

from ngramspec.drafting.config import DEFAULT_CAPACITY
from ngramspec.drafting.index.trie import NgramTrie

# Every test runs on the pure-Python reference and on the native trie (same API, same results).
backends = pytest.mark.parametrize("trie_cls", [ReferenceTrie, NgramTrie], ids=["python", "native"])

streams_strategy = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1,
                            max_size=3)


def naive_ngrams(streams: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for s in streams:
        for end in range(len(s)):
            for n in range(1, min(max_depth, end + 1) + 1):
                counts[tuple(s[end - n + 1 : end + 1])] += 1
    return counts


def trie_ngrams(trie: ReferenceTrie | NgramTrie) -> dict[tuple[int, ...], int]:
    out = {}
    frontier = [(ROOT, ())]
    while frontier:
        node, path = frontier.pop()
        for token, child, count in trie.children(node):
            out[path + (token,)] = count
            frontier.append((child, path + (token,)))
    return out


def feed_interleaved(trie: ReferenceTrie | NgramTrie, streams: list[list[int]], chunk: int) -> None:
    """Commit each stream `chunk` tokens at a time, round-robin, like concurrent requests."""
    states = [trie.new_state() for _ in streams]
    done = [0] * len(streams)
    while any(d < len(s) for d, s in zip(done, streams)):
        for i, s in enumerate(streams):
            if done[i] < len(s):
                end = min(len(s), done[i] + chunk)
                trie.extend(states[i], s[:end], done[i])
                done[i] = end


@backends
@settings(max_examples=60, deadline=None)
@given(streams_strategy, st.integers(2, 6), st.integers(1, 4))
def test_counts_equal_naive_ngram_counts(trie_cls, streams, max_depth, chunk):
    trie = trie_cls(capacity=100_000, max_depth=max_depth)
    feed_interleaved(trie, streams, chunk)
    assert trie_ngrams(trie) == dict(naive_ngrams(streams, max_depth))
    assert trie.num_nodes == 1 + len(naive_ngrams(streams, max_depth))


@backends
@settings(max_examples=60, deadline=None)
@given(streams_strategy, st.integers(2, 5), st.integers(1, 3), st.integers(1, 25))
def test_eviction_invariants(trie_cls, streams, max_depth, chunk, extra):
    capacity = max_depth + extra
    trie = trie_cls(capacity=capacity, max_depth=max_depth)
    feed_interleaved(trie, streams, chunk)
    assert trie.num_nodes <= capacity
    stored = trie_ngrams(trie)
    assert len(stored) == trie.num_nodes - 1  # every live node is reachable from the root
    naive = naive_ngrams(streams, max_depth)
    for gram, count in stored.items():
        assert gram[:-1] == () or gram[:-1] in stored  # prefixes survive: only leaves go
        assert 1 <= count <= naive[gram]
    # Children lists stay sorted by count.
    frontier = [ROOT]
    while frontier:
        node = frontier.pop()
        counts = [c for _, _, c in trie.children(node)]
        assert counts == sorted(counts, reverse=True)
        frontier.extend(child for _, child, _ in trie.children(node))


def brute_anchors(trie: ReferenceTrie | NgramTrie, context: list[int]) -> list[tuple[int, int]]:
    out = []
    for k in range(min(trie.max_depth, len(context)), 0, -1):
        node = trie.lookup(context[len(context) - k :])
        if node >= 0 and trie.has_children(node):
            out.append((node, k))
    return out


@backends
@settings(max_examples=60, deadline=None)
@given(streams_strategy, st.integers(2, 5), st.integers(1, 3), st.integers(1, 40))
def test_anchors_never_stale(trie_cls, streams, max_depth, chunk, extra):
    """After other requests insert (and evict), incremental anchors equal a stateless walk."""
    trie = trie_cls(capacity=max_depth + extra, max_depth=max_depth)
    states = [trie.new_state() for _ in streams]
    done = [0] * len(streams)
    while any(d < len(s) for d, s in zip(done, streams)):
        for i, s in enumerate(streams):
            if done[i] < len(s):
                end = min(len(s), done[i] + chunk)
                trie.extend(states[i], s[:end], done[i])
                done[i] = end
        for i, s in enumerate(streams):
            ctx = s[: done[i]]
            assert trie.anchors(states[i], ctx) == brute_anchors(trie, ctx)


@backends
def test_longest_suffix_found_after_another_request_inserts(trie_cls):
    # SGLang's caveat (§2.3): a null anchor is never re-probed. Here request B's anchors
    # must see "1 2 3 -> 4" as soon as request A inserted it.
    trie = trie_cls(capacity=1000, max_depth=4)
    a, b = trie.new_state(), trie.new_state()
    trie.extend(b, [9, 2, 3], 0)
    trie.extend(a, [1, 2, 3, 4], 0)
    anchors = trie.anchors(b, [9, 2, 3])
    assert [k for _, k in anchors] == [2, 1]  # "2 3" and "3" now have children
    assert trie.children(anchors[0][0]) == [(4, trie.lookup([2, 3, 4]), 1)]


@backends
def test_reset_invalidates_states(trie_cls):
    trie = trie_cls(capacity=100, max_depth=3)
    state = trie.new_state()
    trie.extend(state, [1, 2, 1, 2], 0)
    trie.reset()
    assert trie.num_nodes == 1
    assert trie.anchors(state, [1, 2, 1, 2]) == []
    trie.extend(state, [1, 2, 1, 2, 1], 4)  # rebuilds from the (empty) trie without error
    assert trie.lookup([1]) >= 0


@backends
def test_capacity_must_exceed_depth(trie_cls):
    with pytest.raises(ValueError):
        trie_cls(capacity=4, max_depth=4)


@backends
@settings(max_examples=30, deadline=None)
@given(streams_strategy, st.integers(2, 5), st.integers(0, 30))
def test_arrays_round_trip(trie_cls, streams, max_depth, extra):
    trie = trie_cls(capacity=max_depth + 1 + extra, max_depth=max_depth)
    feed_interleaved(trie, streams, 2)
    meta, arrays = trie.to_arrays()
    again = trie_cls.from_arrays(meta, {k: np.copy(v) for k, v in arrays.items()})
    assert trie_ngrams(again) == trie_ngrams(trie)
    assert again.num_nodes == trie.num_nodes
    # Same future: continue both with the same stream and compare.
    tail = [1, 2, 3, 1, 2, 3]
    trie.extend(trie.new_state(), tail, 0)
    again.extend(trie.new_state(), tail, 0)
    assert trie_ngrams(again) == trie_ngrams(trie)


@backends
def test_from_arrays_rejects_bad_input(trie_cls):
    trie = trie_cls(capacity=100, max_depth=3)
    trie.extend(trie.new_state(), [1, 2, 3], 0)
    meta, arrays = trie.to_arrays()
    with pytest.raises(ValueError):
        trie_cls.from_arrays({**meta, "version": 7}, arrays)
    with pytest.raises(ValueError):
        trie_cls.from_arrays({**meta, "num_nodes": 2}, arrays)
    trie.extend(trie.new_state(), [1, 3], 0)  # root children: 1 and 3 (count 2), then 2
    meta, arrays = trie.to_arrays()
    assert arrays["token"][1:4].tolist() == [1, 3, 2]
    assert arrays["count"][1:4].tolist() == [2, 2, 1]
    swapped = dict(arrays, count=arrays["count"].copy())
    swapped["count"][1:4] = [2, 1, 2]  # siblings out of count order
    with pytest.raises(ValueError, match="count order"):
        trie_cls.from_arrays(meta, swapped)


@backends
def test_bytes_per_node_budget(trie_cls):
    """The default capacity must keep a full trie under 1 GiB; measured on a chain-heavy stream."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 30_000, size=rng.integers(3, 10)).tolist() for _ in range(200)]
    stream: list[int] = []
    while len(stream) < 3000:
        stream.extend(phrases[int(rng.integers(0, 200))])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = trie_cls(capacity=10_000_000, max_depth=18)
    trie.extend(trie.new_state(), stream, 0)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_node = (after - before) / trie.num_nodes
    assert trie.num_nodes > 10_000
    assert per_node * DEFAULT_CAPACITY < 2**30, f"{per_node:.0f} B/node on {sys.version_info[:2]}"
