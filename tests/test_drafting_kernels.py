"""The compiled drafter and its indexes against the pure-Python references (tests/oracles/):
identical results."""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.context import ReferenceContextIndex
from oracles.drafter import ReferenceDrafter
from oracles.trie import ReferenceTrie

from ngramspec.drafting.config import DEFAULT_CAPACITY, DrafterConfig
from ngramspec.drafting.drafter import NgramDrafter
from ngramspec.drafting.index.context import ContextIndex
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.index.trie import NgramTrie
from ngramspec.drafting.kernels import layout
from ngramspec.drafting.tree import DraftTree

small_tokens = st.lists(st.integers(0, 5), min_size=1, max_size=20)


def same_arrays(a: ReferenceTrie | NgramTrie, b: ReferenceTrie | NgramTrie) -> None:
    meta_a, arrays_a = a.to_arrays()
    meta_b, arrays_b = b.to_arrays()
    assert meta_a == meta_b
    assert arrays_a.keys() == arrays_b.keys()
    for name in arrays_a:
        assert arrays_a[name].dtype == arrays_b[name].dtype
        assert arrays_a[name].tolist() == arrays_b[name].tolist(), name


# ---------------------------------------------------------------------- trie


@settings(max_examples=40, deadline=None)
@given(st.lists(small_tokens, min_size=1, max_size=4), st.integers(2, 6), st.integers(1, 30),
       st.integers(1, 4))
def test_trie_identical_after_every_step_with_eviction(streams, depth, extra, chunk):
    """Same nodes, counts, child order, LRU and anchors, step by step (capacity forces eviction)."""
    ref, fast = ReferenceTrie(depth + extra, depth), NgramTrie(depth + extra, depth)
    states = [(ref.new_state(), fast.new_state()) for _ in streams]
    done = [0] * len(streams)
    while any(d < len(s) for d, s in zip(done, streams)):
        for i, s in enumerate(streams):
            if done[i] < len(s):
                end = min(len(s), done[i] + chunk)
                ref.extend(states[i][0], s[:end], done[i])
                fast.extend(states[i][1], s[:end], done[i])
                done[i] = end
                assert ref.anchors(states[i][0], s[:end]) == fast.anchors(states[i][1], s[:end])
                same_arrays(ref, fast)
    assert (ref.num_nodes, ref.num_evicted) == (fast.num_nodes, fast.num_evicted)


def test_trie_identical_through_growth_and_eviction():
    """A long stream: column growth, re-hashing, then eviction at capacity."""
    rng = np.random.default_rng(1)
    phrases = [rng.integers(0, 300, size=int(rng.integers(2, 8))).tolist() for _ in range(200)]
    stream: list[int] = []
    while len(stream) < 4000:
        stream.extend(phrases[int(rng.integers(0, 200))])
    ref, fast = ReferenceTrie(10_000, 8), NgramTrie(10_000, 8)
    sr, sf = ref.new_state(), fast.new_state()
    for start in range(0, len(stream), 97):
        end = min(len(stream), start + 97)
        ref.extend(sr, stream[:end], start)
        fast.extend(sf, stream[:end], start)
    assert ref.num_evicted > 0
    same_arrays(ref, fast)


@settings(max_examples=25, deadline=None)
@given(st.lists(small_tokens, min_size=1, max_size=3), st.integers(2, 5), st.integers(1, 20))
def test_trie_arrays_load_across_backends(streams, depth, extra):
    """Either backend's to_arrays loads into the other and both continue identically."""
    ref = ReferenceTrie(depth + extra, depth)
    for s in streams:
        ref.extend(ref.new_state(), s, 0)
    fast = NgramTrie.from_arrays(*ref.to_arrays())
    back = ReferenceTrie.from_arrays(*fast.to_arrays())
    same_arrays(ref, fast)
    tail = [1, 2, 3, 1, 2, 4, 5]
    for trie in (ref, fast, back):
        trie.extend(trie.new_state(), tail, 0)
    same_arrays(ref, fast)
    same_arrays(ref, back)


def test_fast_trie_bytes_per_node():
    """Arrays make a node small: the default capacity stays far below 1 GiB."""
    trie = NgramTrie(DEFAULT_CAPACITY, 18)
    trie.reserve(DEFAULT_CAPACITY)  # fully grown: columns and tables at their final size
    per_node = trie.nbytes() / DEFAULT_CAPACITY
    assert per_node < 64
    assert per_node * DEFAULT_CAPACITY < 2**30


# ---------------------------------------------------------------------- context index


def test_context_index_identical_through_growth():
    rng = np.random.default_rng(2)
    ref, fast = ReferenceContextIndex(16, 64), ContextIndex(16, 64)
    for doc in ([1, 2, 3, 4], [5, 1, 2]):
        ref.add_document(doc)
        fast.add_document(doc)
    for _ in range(300):  # ~6000 tokens: arrays and table grow several times
        chunk = rng.integers(0, 12, size=int(rng.integers(1, 40))).tolist()
        ref.extend(chunk)
        fast.extend(chunk)
        assert ref.anchors(3) == fast.anchors(3)
    assert ref.tokens == fast.tokens.tolist()


# ---------------------------------------------------------------------- drafter


def automaton(docs: list[list[int]]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for doc in docs:
        sam.add_document(doc)
    sam.finalize()
    return sam


class StubCorpora:
    """Named corpora; `rotate` drops the first and re-adds it under a new name (a new snapshot)."""

    def __init__(self, *corpora: list[list[int]]) -> None:
        self.sams = {f"c{i}": automaton(docs) for i, docs in enumerate(corpora)}
        self.added = len(corpora)

    def rotate(self) -> None:
        first = next(iter(self.sams))
        self.sams[f"z{self.added}"] = self.sams.pop(first)
        self.added += 1

    def snapshot(self) -> dict[str, SuffixAutomaton]:
        return dict(self.sams)


configs = st.fixed_dictionaries({
    "capacity": st.sampled_from([25, 60, 100_000]),
    "max_trie_depth": st.integers(2, 8),
    "max_context_match": st.integers(1, 6),
    "max_context_occurrences": st.integers(1, 8),
    "max_anchors_per_source": st.integers(1, 3),
    "max_bfs_breadth": st.integers(1, 4),
    "draft_token_num": st.integers(1, 12),
    "min_path_prob": st.sampled_from([0.0, 0.05]),
    "calibrate": st.booleans(),
    "insert_prompt": st.booleans(),
    "request_gain_prior": st.sampled_from([0.0, 1.0, 4.0]),
    "request_gain_decay": st.sampled_from([0.5, 1.0]),
    "max_wildcards": st.integers(0, 2),
    "trie_fallback": st.booleans(),
})


def tree_key(tree) -> tuple:
    return tree.token_ids, tree.parents, tree.probs, tree.sources


def run_lockstep(data, config: dict, corpora: StubCorpora | None, steps: int) -> None:
    """Random start/propose/commit/stop/reset sequences on both backends; trees must match."""
    ref = ReferenceDrafter(DrafterConfig(**config), corpora)
    fast = NgramDrafter(DrafterConfig(**config), corpora)
    live: dict[str, list[int]] = {}
    for step in range(steps):
        op = data.draw(st.sampled_from(["start", "step", "step", "step", "commit", "stop",
                                        "reset", "flush", "reload", "corpora"]))
        if op == "start" or not live:
            rid = f"r{step}"
            prompt = data.draw(small_tokens)
            refs = data.draw(st.one_of(st.none(), st.lists(small_tokens, max_size=2)))
            for d in (ref, fast):
                d.start(rid, prompt, refs)
            live[rid] = data.draw(st.lists(st.integers(0, 5), min_size=12, max_size=12))
        elif op == "step":  # some requests, in any order; some of them commit
            ids = data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1,
                                     max_size=len(live), unique=True))
            budgets = data.draw(st.lists(st.integers(0, 12), min_size=len(ids),
                                         max_size=len(ids)))
            trees = ref.propose(ids, budgets)
            fast_trees = fast.propose(ids, budgets)
            assert [tree_key(t) for t in trees] == [tree_key(t) for t in fast_trees]
            for tree in fast_trees:  # built without re-validation: check it here
                DraftTree(*tree_key(tree))
            commits = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
            for rid, tree, commit in zip(ids, trees, commits):
                if not commit and len(ids) > 1:
                    continue  # its tree stays pending until it commits later
                future = live[rid]
                accepted = [tree.token_ids[i] for i in tree.accepted_nodes(future)]
                emitted = accepted + [future[len(accepted)]] if len(accepted) < 12 else accepted
                for d in (ref, fast):
                    d.commit(rid, emitted)
                live[rid] = future[len(emitted):] + data.draw(
                    st.lists(st.integers(0, 5), min_size=len(emitted), max_size=len(emitted)))
        elif op == "commit":  # tokens without a draft (the prefill's token, a plain decode)
            rid = data.draw(st.sampled_from(sorted(live)))
            emitted = live[rid][:data.draw(st.integers(1, 3))]
            for d in (ref, fast):
                d.commit(rid, emitted)
            live[rid] = live[rid][len(emitted):] + data.draw(
                st.lists(st.integers(0, 5), min_size=len(emitted), max_size=len(emitted)))
        elif op == "stop":
            rid = data.draw(st.sampled_from(sorted(live)))
            for d in (ref, fast):
                d.stop(rid)
            del live[rid]
        elif op == "corpora":  # the corpus registry changed under live requests
            if corpora is not None:
                corpora.rotate()
        elif op == "flush":  # the server's flush: the trie forgets, requests keep going
            for d in (ref, fast):
                d.trie.reset()
        elif op == "reload":  # the server's install of a saved trie under live requests
            for d in (ref, fast):
                trie = type(d.trie).from_arrays(*d.trie.to_arrays())
                trie.epoch = d.trie.epoch + 1
                d.trie = trie
        else:
            for d in (ref, fast):
                d.reset()
            live.clear()
    assert ref.stats() == fast.stats()
    (ref_meta, ref_arrays), (fast_meta, fast_arrays) = ref.trie.to_arrays(), fast.trie.to_arrays()
    assert ref_meta == fast_meta
    assert {k: v.tolist() for k, v in ref_arrays.items()} == \
        {k: v.tolist() for k, v in fast_arrays.items()}


@settings(max_examples=60, deadline=None)
@given(st.data(), configs)
def test_drafters_build_identical_trees(data, config):
    run_lockstep(data, config, None, 25)


@settings(max_examples=20, deadline=None)
@given(st.data(), configs, st.lists(small_tokens, min_size=1, max_size=3))
def test_drafters_identical_with_external_corpora(data, config, docs):
    run_lockstep(data, config, StubCorpora(docs), 15)


@settings(max_examples=15, deadline=None)
@given(st.data(), configs, st.lists(st.lists(small_tokens, min_size=1, max_size=3), min_size=2,
                                    max_size=3))
def test_drafters_identical_with_several_corpora(data, config, corpora):
    """Several corpora read as one concatenated bank; snapshots change under live requests."""
    run_lockstep(data, config, StubCorpora(*corpora), 15)


def _trie_lists(drafter) -> tuple:
    meta, arrays = drafter.trie.to_arrays()
    return meta, {k: v.tolist() for k, v in arrays.items()}


def test_first_commits_without_prompt_insertion_evict_like_the_reference():
    # Without prompt insertion a request's first commit must anchor on its prompt: the anchors
    # pin the nodes it extends, so a full trie evicts the same nodes as the reference's.
    config = DrafterConfig(capacity=8, max_trie_depth=3, insert_prompt=False)
    ref, fast = ReferenceDrafter(config), NgramDrafter(config)
    for d in (ref, fast):
        d.start("r0", [3, 4])
        d.start("r1", [2, 3, 3, 5])
        d.commit("r0", [4, 0, 3, 5])
        d.commit("r1", [4, 0, 2, 2])
    assert _trie_lists(ref) == _trie_lists(fast)


def test_a_corpus_change_keeps_the_pending_trees_of_requests_not_rebuilt():
    # A request proposed before the corpora changed and committed after learns from its own tree.
    corpora = StubCorpora([[1, 2, 3, 1, 2, 4]], [[2, 3, 9]])
    ref, fast = ReferenceDrafter(DrafterConfig(), corpora), NgramDrafter(DrafterConfig(), corpora)
    for d in (ref, fast):
        d.start("a", [1, 2, 3, 1, 2])
        d.start("b", [5, 1, 2, 3, 1, 2])
    for d in (ref, fast):
        d.propose(["a", "b"], [11, 11])
        d.commit("a", [3, 1])
    corpora.rotate()
    for d in (ref, fast):
        d.propose(["a"], [11])
        d.commit("b", [3, 1, 2])
    assert ref.stats() == fast.stats()
    assert fast.stats()["sources"]["context"]["accepted"] > 1


def test_a_trie_of_another_depth_is_refused() -> None:
    """The kernels' scratch holds 2 x the configured depth: a deeper trie would overrun it."""
    drafter = NgramDrafter(DrafterConfig(max_trie_depth=4))
    drafter.start("a", [1, 2, 3, 1, 2])
    with pytest.raises(ValueError, match="trie depth 6 differs"):
        drafter.trie = NgramTrie(100, 6)
    drafter.trie = NgramTrie(100, 4)
    assert drafter.propose(["a"], [3])[0].token_ids[0] == 2  # still serving


def test_the_step_kernel_refuses_wrong_arrays() -> None:
    """The native Drafter reads its arrays by address (drafter.cpp `take`): a strided view would
    be read as if it were contiguous, a queue of another item type as int64, and a slot without
    arrays would be read from nowhere. Each is refused by name, and the drafter still serves."""
    drafter = NgramDrafter(DrafterConfig())
    drafter.start("a", [1, 2, 3, 1, 2])
    drafter.propose(["a"], [3])  # hands the kernel its shared arrays
    state, nodes, slot = drafter._state, drafter._nodes, drafter._requests["a"].slot
    out, out_p = np.empty((1, 3 * nodes + 1), np.int64), np.empty((1, nodes))
    io = array.array("q", [slot, 3])
    assert state.propose(io, 0, out, out_p, 0.0, False) == 0
    assert out[0, 3 * nodes] >= 1
    with pytest.raises(TypeError, match="io: expected a C-contiguous 1-d int64"):
        state.propose(array.array("i", [slot, 3]), 0, out, out_p, 0.0, False)
    with pytest.raises(TypeError, match="out: expected a writable C-contiguous"):
        state.propose(io, 0, np.zeros((2, 2 * out.shape[1]), np.int64)[:, ::2], out_p, 0.0,
                      False)
    with pytest.raises(TypeError, match="out_p: expected a C-contiguous 2-d float64"):
        state.propose(io, 0, out, out_p.astype(np.float32), 0.0, False)
    with pytest.raises(ValueError, match="output rows"):
        state.propose(io, 0, out[:0], out_p, 0.0, False)
    assert state.propose(array.array("q", [slot + 1, 3]), 0, out, out_p, 0.0, False) \
        == layout.BAD_SLOT
    arrays = list(drafter._requests["a"].arrays())
    arrays[0] = np.zeros(2 * len(arrays[0]), np.int32)[::2]
    with pytest.raises(TypeError, match="tok: expected a writable C-contiguous"):
        state.set_request(slot, *arrays)
    arrays[0] = arrays[0].astype(np.int64)
    with pytest.raises(TypeError, match="tok: expected a C-contiguous 1-d int32"):
        state.set_request(slot, *arrays)
    assert drafter.propose(["a"], [3])[0].token_ids[0] == 2  # still serving


class _Lockstep:
    """Two drafters driven alike; every propose must give the same trees."""

    def __init__(self, a: NgramDrafter, b: NgramDrafter) -> None:
        self.a, self.b, self.proposes = a, b, 0

    def start(self, request_id, prompt, references=None) -> None:
        self.a.start(request_id, prompt, references=references)
        self.b.start(request_id, prompt, references=references)

    def propose(self, request_ids, budgets):
        trees_a = self.a.propose(request_ids, budgets)
        trees_b = self.b.propose(request_ids, budgets)
        for x, y in zip(trees_a, trees_b, strict=True):
            assert (x.token_ids, x.parents, x.probs, x.sources) == \
                (y.token_ids, y.parents, y.probs, y.sources)
        self.proposes += len(request_ids) >= 12  # the threaded kernel's threshold at 3 threads
        return trees_a

    def commit(self, request_id, accepted_token_ids) -> None:
        self.a.commit(request_id, accepted_token_ids)
        self.b.commit(request_id, accepted_token_ids)

    def stop(self, request_id) -> None:
        self.a.stop(request_id)
        self.b.stop(request_id)


def test_threaded_builds_give_the_same_trees() -> None:
    """draft_threads builds a batch's trees on several threads (drafter.cpp `propose`,
    parallel): the trees, counts and calibration are those of one thread, with and
    without a corpus."""
    from pathlib import Path

    from ngramspec.simulator.replay import read_streams, replay

    root = Path(__file__).resolve().parent.parent
    streams = read_streams([root / "data/streams/spec_bench.jsonl"])[:24]
    corpus = SuffixAutomaton()
    for s in streams[:6]:
        corpus.add_document(list(s.output_ids))
    corpus.finalize()

    class _Corpora:
        def snapshot(self) -> dict:
            return {"earlier": corpus}

    for corpora in (None, _Corpora()):
        one = NgramDrafter(DrafterConfig(), corpora)
        three = NgramDrafter(DrafterConfig(draft_threads=3), corpora)
        both = _Lockstep(one, three)
        replay(both, streams, 11, 24)
        assert both.proposes > 50  # most batches went through the threaded kernel
        assert one.stats() == three.stats()


def test_draft_threads_is_validated() -> None:
    with pytest.raises(ValueError, match="draft_threads"):
        DrafterConfig(draft_threads=0)


def test_a_batch_naming_a_request_twice_is_built_by_one_thread() -> None:
    """Two threads must never build one request at once: such a batch takes the serial kernel
    and gives what one thread gives."""
    one, two = NgramDrafter(DrafterConfig()), NgramDrafter(DrafterConfig(draft_threads=2))
    ids = [f"r{i}" for i in range(8)]
    for d in (one, two):
        for i, rid in enumerate(ids):
            d.start(rid, [1, 2, 3, i, 1, 2, 3, i + 1, 1, 2])
    batch = ids + ids  # each request twice
    trees_one, trees_two = one.propose(batch, [5] * 16), two.propose(batch, [5] * 16)
    assert [t.token_ids for t in trees_one] == [t.token_ids for t in trees_two]
    assert trees_two[0].token_ids == trees_two[8].token_ids


