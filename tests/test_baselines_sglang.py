"""The `sglang` preset against SGLang's own CPU unit tests (test_ngram_corpus.py, §6 of
sglang_ngram.md) plus property tests. The only hard-coded results are SGLang's goldens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.baselines.sglang.corpus import (
    SGLangCorpus,
    SGLangParams,
    leaf_paths_from_mask,
    parents_from_mask,
)
from ngramspec.baselines.sglang.cxx import CxxIntMap, CxxMaxHeap
from ngramspec.baselines.sglang.drafter import SGLangDrafter
from ngramspec.baselines.sglang.trie import SGLangTrie
from ngramspec.drafting.index.sam import SEPARATOR, SuffixAutomaton
from ngramspec.drafting.sources import CORPUS, TRIE
from ngramspec.drafting.tree import DraftTree

SEED_SEQUENCES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]]
QUERY_SEQUENCES = [[1, 2, 3], [3, 44], [3, 6, 999]]
# SGLang's goldens (test_ngram_corpus.py); they pin libstdc++'s hash-map and heap orders.
EXPECTED_BFS_IDS = [
    [3, 4, 44, 5, 55, 6, 66, 77], [44, 55, 66, 77, 88, 99, 100, 0], [999, 0, 0, 0, 0, 0, 0, 0],
]
EXPECTED_PROB_IDS = [
    [3, 44, 4, 55, 5, 66, 6, 7], [44, 55, 66, 77, 88, 99, 100, 0], [999, 0, 0, 0, 0, 0, 0, 0],
]
TWO_BRANCH_MASK = [  # BFS and PROB, first query: two interleaved chains under the root
    [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 1, 0, 0],
    [1, 0, 1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1, 1],
]
CHAIN_MASK = [  # second query: a 6-chain plus one padding row (a root child)
    [1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1],
]
PADDING_MASK = [[1 if j in (0, i) else 0 for j in range(8)] for i in range(8)]


def make_corpus(match_type: str = "BFS", sams: dict | None = None, **kw: int) -> SGLangCorpus:
    """SGLang's test fixture: D=12, breadth 1..8, d=8, capacity 100000."""
    values = dict(max_trie_depth=12, min_bfs_breadth=1, max_bfs_breadth=8, draft_token_num=8,
                  capacity=100_000, external_sam_budget=0)
    values.update(kw)
    return SGLangCorpus(SGLangParams(match_type=match_type, **values), sams)


_fresh = iter(range(10**9))


def get(corpus: SGLangCorpus, queries: list[list[int]]) -> tuple[list[list[int]], list]:
    """Stateless lookups (a new state key per query, like upstream's uuid4 request ids)."""
    d = corpus.params.draft_token_num
    tokens, mask = corpus.batch_get([f"q{next(_fresh)}" for _ in queries], queries,
                                    [len(q) for q in queries])
    ids = [tokens[i * d:(i + 1) * d] for i in range(len(queries))]
    masks = [[mask[(i * d + r) * d:(i * d + r + 1) * d] for r in range(d)]
             for i in range(len(queries))]
    return ids, masks


def get_with_state(corpus: SGLangCorpus, key: str, tail: list[int], total_len: int):
    return corpus.batch_get([key], [tail], [total_len])


def make_sam(*documents: list[int]) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    for doc in documents:
        sam.add_document(doc)
    sam.finalize()
    return sam


# ---------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("match_type,expected_ids", [
    ("BFS", EXPECTED_BFS_IDS), ("PROB", EXPECTED_PROB_IDS),
])
def test_golden_trees(match_type: str, expected_ids: list[list[int]]) -> None:
    corpus = make_corpus(match_type)
    corpus.batch_put(SEED_SEQUENCES)
    ids, masks = get(corpus, QUERY_SEQUENCES)
    assert ids == expected_ids
    assert masks == [TWO_BRANCH_MASK, CHAIN_MASK, PADDING_MASK]


def test_batched_equals_individual() -> None:
    corpus = make_corpus()
    corpus.batch_put(SEED_SEQUENCES)
    batch_ids, batch_masks = get(corpus, QUERY_SEQUENCES)
    for i, query in enumerate(QUERY_SEQUENCES):
        ids, masks = get(corpus, [query])
        assert (ids[0], masks[0]) == (batch_ids[i], batch_masks[i])


def test_no_match_and_empty_corpus_give_root_plus_zeros() -> None:
    corpus = make_corpus()
    assert get(corpus, [[1, 2, 3]])[0] == [[3] + [0] * 7]  # empty corpus
    corpus.batch_put([[10, 20, 30, 40, 50]])
    assert get(corpus, [[999, 888, 777]])[0] == [[777] + [0] * 7]


def test_incremental_inserts_accumulate() -> None:
    corpus = make_corpus()
    corpus.batch_put([[1, 2, 3, 4, 5]])
    corpus.batch_put([[1, 2, 3, 44, 55]])
    ids = get(corpus, [[1, 2, 3]])[0][0]
    assert 4 in ids and 44 in ids


def test_small_capacity_still_returns_d_tokens() -> None:
    corpus = make_corpus(capacity=200)
    corpus.batch_put([list(range(1, 101))])
    assert len(get(corpus, [[50, 51, 52]])[0][0]) == 8
    assert corpus.trie.num_nodes <= 200


def test_squeeze_keeps_recent() -> None:
    corpus = make_corpus(capacity=500, max_trie_depth=6)
    corpus.batch_put([list(range(1000, 1050))])
    corpus.batch_put([list(range(2000, 2050))])
    ids = get(corpus, [[2000, 2001, 2002]])[0][0]
    assert ids[0] == 2002 and 2003 in ids


def test_squeeze_evicts_old() -> None:
    corpus = make_corpus(capacity=150, max_trie_depth=6)
    corpus.batch_put([list(range(5000, 5030))])
    assert 5003 in get(corpus, [[5000, 5001, 5002]])[0][0]
    for i in range(5):
        corpus.batch_put([list(range(6000 + i * 30, 6030 + i * 30))])
    assert 5003 not in get(corpus, [[5000, 5001, 5002]])[0][0]


def test_leaf_path_helper() -> None:
    tokens = [3, 4, 44, 5, 55]
    mask = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    assert leaf_paths_from_mask(tokens, mask) == [[3, 4, 5], [3, 44, 55]]
    assert leaf_paths_from_mask([10, 20, 30], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]) == [[10, 20, 30]]


def test_prob_frequency_boost() -> None:
    corpus = make_corpus("PROB", draft_token_num=2, max_bfs_breadth=1, max_trie_depth=5)
    corpus.batch_put([[1, 2, 3, 10, 11]])
    corpus.batch_put([[1, 2, 3, 20, 21]] * 10)
    assert get(corpus, [[1, 2, 3]])[0][0][1] == 20


def test_bfs_recency() -> None:
    corpus = make_corpus("BFS", draft_token_num=2, max_bfs_breadth=1, max_trie_depth=5)
    corpus.batch_put([[1, 2, 3, 10, 11]])
    corpus.batch_put([[1, 2, 3, 20, 21]])
    assert get(corpus, [[1, 2, 3]])[0][0][1] == 20


def test_shared_suffix_both_continuations() -> None:
    corpus = make_corpus()
    corpus.batch_put([[100, 200, 7, 8, 9, 50, 51], [300, 400, 7, 8, 9, 60, 61]])
    ids = get(corpus, [[7, 8, 9]])[0][0]
    assert 50 in ids and 60 in ids


def test_single_token_context() -> None:
    corpus = make_corpus()
    corpus.batch_put([[5, 10, 20, 30]])
    ids = get(corpus, [[5]])[0][0]
    assert ids[0] == 5 and 10 in ids


def test_context_longer_than_depth() -> None:
    corpus = make_corpus(max_trie_depth=6)
    corpus.batch_put([list(range(1, 20))])
    ids = get(corpus, [list(range(1, 16))])[0][0]
    assert ids[0] == 15 and 16 in ids
    corpus = make_corpus(max_trie_depth=6, draft_token_num=4)
    corpus.batch_put([[1, 2, 3, 4, 5, 6, 7], [99, 3, 4, 5, 6, 8]])
    ids = get(corpus, [[2, 3, 4, 5, 6]])[0][0]
    assert 7 in ids and 8 in ids  # the longest and a shorter stored suffix both contribute


def test_reset_then_reinsert() -> None:
    corpus = make_corpus()
    corpus.batch_put(SEED_SEQUENCES)
    assert any(get(corpus, [[1, 2, 3]])[0][0][1:])
    corpus.reset()
    assert get(corpus, [[1, 2, 3]])[0][0] == [3] + [0] * 7
    corpus.batch_put([[10, 20, 30, 40, 50]])
    assert get(corpus, [[1, 2, 3]])[0][0] == [3] + [0] * 7
    ids = get(corpus, [[10, 20, 30]])[0][0]
    assert ids[0] == 30 and 40 in ids


# ------------------------------------------------------------------- incremental match state


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_incremental_equals_stateless_without_inserts(match_type: str) -> None:
    corpus = make_corpus(match_type, max_trie_depth=4, draft_token_num=4)
    corpus.batch_put([[1, 2, 3, 4, 5, 6], [9, 3, 4, 7, 8]])
    for full in ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):
        tail = full[-4:]
        incremental = get_with_state(corpus, "req", tail, len(full))
        assert incremental == corpus.batch_get([f"fresh{len(full)}"], [tail], [len(full)])


def test_leaf_anchor_becomes_expandable() -> None:
    corpus = make_corpus(max_trie_depth=4, draft_token_num=4)
    corpus.batch_put([[1, 2, 3]])
    tokens, _ = get_with_state(corpus, "leaf", [2, 3], 2)
    assert tokens[1:] == [0, 0, 0]  # [2, 3] is in the trie but is a leaf
    corpus.batch_put([[9, 2, 3, 4]])
    incremental = get_with_state(corpus, "leaf", [2, 3], 2)
    assert incremental == corpus.batch_get(["fresh"], [[2, 3]], [2])
    assert 4 in incremental[0]


def test_stale_state_rebuilt_after_eviction() -> None:
    corpus = make_corpus(capacity=150, max_trie_depth=6, draft_token_num=4)
    corpus.batch_put([list(range(5000, 5030))])
    get_with_state(corpus, "evicted", [5000, 5001, 5002], 3)
    for i in range(5):
        corpus.batch_put([list(range(6000 + i * 30, 6030 + i * 30))])
    incremental = get_with_state(corpus, "evicted", [5000, 5001, 5002], 3)
    assert incremental == corpus.batch_get(["fresh"], [[5000, 5001, 5002]], [3])


@pytest.mark.parametrize("exact", [False, True])
def test_stale_null_anchor_caveat(exact: bool) -> None:
    # [5, 6] is absent when the state caches it; inserting [5, 6, 7, 8] later is missed by the
    # incremental advance (§2.3 caveat) but found by exact matching and by a fresh state.
    corpus = make_corpus(max_trie_depth=4, draft_token_num=2, max_bfs_breadth=1,
                         exact_match=exact)
    corpus.batch_put([[6, 9]])
    get_with_state(corpus, "r", [5, 6], 2)
    corpus.batch_put([[5, 6, 7, 8], [0, 6, 7, 9]])  # [6, 7] then continues with 9 most recently
    tokens, _ = get_with_state(corpus, "r", [5, 6, 7], 3)
    assert corpus.batch_get(["fresh"], [[5, 6, 7]], [3])[0] == [7, 8]
    assert tokens == ([7, 8] if exact else [7, 9])


# ---------------------------------------------------------------------------- external SAMs


def test_sam_only_chain_and_document_boundaries() -> None:
    corpus = make_corpus(draft_token_num=4, external_sam_budget=3,
                         sams={"a": make_sam([1, 2, 3, 4, 5])})
    assert get(corpus, [[1, 2, 3]])[0][0][:3] == [3, 4, 5]
    corpus = make_corpus(draft_token_num=4, external_sam_budget=3,
                         sams={"a": make_sam([1, 2, 3], [4, 5, 6])})
    assert get(corpus, [[2, 3]])[0][0] == [3, 0, 0, 0]  # the separator is never drafted across
    corpus = make_corpus(draft_token_num=4, external_sam_budget=3,
                         sams={"a": make_sam([1, 2, 3, 4, 5], [8, 9])})
    assert corpus.sams["a"].num_tokens == 8  # 5 + separator + 2
    assert get(corpus, [[1, 2, 3]])[0][0][1:3] == [4, 5]


def sam_paths(corpus: SGLangCorpus, query: list[int]) -> tuple[list[int], list[list[int]]]:
    ids, masks = get(corpus, [query])
    return ids[0], leaf_paths_from_mask(ids[0], masks[0])


def test_sam_adds_distinct_root_branch() -> None:
    corpus = make_corpus(draft_token_num=6, external_sam_budget=2,
                         sams={"a": make_sam([1, 2, 3, 20, 21])})
    corpus.batch_put([[1, 2, 3, 10, 11]])
    _, paths = sam_paths(corpus, [1, 2, 3])
    assert [3, 10, 11] in paths and [3, 20, 21] in paths


@pytest.mark.parametrize("d,zeros", [(5, 1), (6, 2)])
def test_sam_shared_prefix_merge_underfills(d: int, zeros: int) -> None:
    corpus = make_corpus(draft_token_num=d, external_sam_budget=2,
                         sams={"a": make_sam([1, 2, 3, 10, 99])})
    corpus.batch_put([[1, 2, 3, 10, 11]])
    ids, paths = sam_paths(corpus, [1, 2, 3])
    assert [3, 10, 11] in paths and [3, 10, 99] in paths
    assert ids.count(0) == zeros


def test_sam_prob_prefers_frequent_continuation() -> None:
    sam = make_sam([1, 2, 3, 10], [1, 2, 3, 20], [1, 2, 3, 20], [1, 2, 3, 20])
    corpus = make_corpus("PROB", draft_token_num=2, max_bfs_breadth=1, external_sam_budget=1,
                         sams={"a": sam})
    assert get(corpus, [[1, 2, 3]])[0] == [[3, 20]]


def test_two_sams_both_contribute_and_removal() -> None:
    sams = {"a": make_sam([1, 2, 3, 10, 11]), "b": make_sam([1, 2, 3, 20, 21])}
    corpus = make_corpus(draft_token_num=6, external_sam_budget=4, sams=sams)
    _, paths = sam_paths(corpus, [1, 2, 3])
    assert [3, 10, 11] in paths and [3, 20, 21] in paths
    del corpus.sams["b"]
    _, paths = sam_paths(corpus, [1, 2, 3])
    assert [3, 10, 11] in paths and [3, 20, 21] not in paths


def test_budget_split() -> None:
    corpus = make_corpus(draft_token_num=12, external_sam_budget=5,
                         sams={"a": make_sam([1]), "b": make_sam([2])})
    assert corpus.budgets(11) == (7, 2)
    assert corpus.budgets(1) == (1, 0)  # per_sam == 0: SAMs silently ignored, trie gets all
    corpus.sams.clear()
    assert corpus.budgets(11) == (11, 0)


def test_reconstruct_vector_via_draft_tree() -> None:
    # §3.1: reconstruct_indices_from_tree_mask's test vector.
    mask = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    tree = DraftTree([7, 8, 9, 10], parents_from_mask(mask))
    assert tree.first_child_next_sibling() == ([1, -1, 3, -1], [-1, 2, -1, -1])
    assert tree.positions(12) == [12, 13, 13, 14]
    assert [[int(v) for v in row] for row in tree.ancestor_mask()] == mask


# ------------------------------------------------------------------ libstdc++ order emulation


def test_cxx_map_order_is_reverse_insertion_for_distinct_buckets() -> None:
    m = CxxIntMap()
    for key in (4, 1, 9, 2):
        m.insert(key, key * 10)
    assert list(m.items()) == [(2, 20), (9, 90), (1, 10), (4, 40)]
    assert m.get(9) == 90 and m.get(5) is None


def test_cxx_map_bucket_collision_and_rehash() -> None:
    m = CxxIntMap()  # 13 buckets after the first insert: 5 and 18 collide
    for key in (5, 7, 18):
        m.insert(key, 0)
    assert [k for k, _ in m.items()] == [7, 18, 5]  # 18 joins the front of 5's bucket run
    for key in range(100, 111):  # 14 keys: rehash to 29 buckets re-threads the list
        m.insert(key, 0)
    keys = [k for k, _ in m.items()]
    assert sorted(keys) == sorted([5, 7, 18, *range(100, 111)])
    assert keys[0] == 110  # the newest key still lands at the front (its bucket was empty)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40))
def test_cxx_heap_pops_in_nonincreasing_order(values: list[int]) -> None:
    heap: CxxMaxHeap[tuple[int, int]] = CxxMaxHeap(key=lambda item: item[0])
    for i, v in enumerate(values):
        heap.push((v, i))
    popped = [heap.pop() for _ in range(len(values))]
    assert [v for v, _ in popped] == sorted(values, reverse=True)
    assert sorted(popped) == sorted((v, i) for i, v in enumerate(values))


# ------------------------------------------------------------------------ property tests

tokens_st = st.lists(st.integers(0, 5), min_size=1, max_size=12)


def occurs(needle: list[int], haystacks: list[list[int]]) -> bool:
    n = len(needle)
    return any(h[i:i + n] == needle for h in haystacks for i in range(len(h) - n + 1))


def check_tree(result_tokens: list[int], parents: list[int], budget: int) -> DraftTree:
    tree = DraftTree(result_tokens, parents)  # validates parents[i] < i
    assert tree.num_drafts <= budget
    for kids in tree.children():
        sibling_tokens = [tree.token_ids[k] for k in kids]
        assert len(sibling_tokens) == len(set(sibling_tokens))
    return tree


@settings(max_examples=80, deadline=None)
@given(windows=st.lists(tokens_st, max_size=6), context=tokens_st,
       match_type=st.sampled_from(["BFS", "PROB"]), depth=st.integers(2, 6),
       d=st.integers(1, 10), max_bfs=st.integers(1, 4))
def test_trie_trees_are_valid_and_grounded(windows, context, match_type, depth, d, max_bfs):
    corpus = make_corpus(match_type, max_trie_depth=depth, draft_token_num=d,
                         max_bfs_breadth=max_bfs, capacity=10_000)
    corpus.batch_put(windows)
    result = corpus.match_tree("k", context, len(context))
    tree = check_tree(result.token_ids, result.parents, d - 1)
    assert tree.token_ids[0] == context[-1]
    padded_tokens, mask = result.padded(d)
    assert padded_tokens[:len(tree)] == tree.token_ids and len(mask) == d
    assert [row[:len(tree)] for row in mask[:len(tree)]] == [
        [int(v) for v in row] for row in tree.ancestor_mask()]
    for path_nodes in (tree.path_to(i) for i in range(1, len(tree))):
        path = [tree.token_ids[i] for i in path_nodes]
        # Every draft extends some matched context suffix inside one stored D-gram.
        assert any(occurs(context[-k:] + path, windows) and k + len(path) <= depth
                   for k in range(1, min(len(context), depth) + 1))


@settings(max_examples=60, deadline=None)
@given(documents=st.lists(tokens_st, min_size=1, max_size=4), context=tokens_st,
       match_type=st.sampled_from(["BFS", "PROB"]), d=st.integers(2, 10))
def test_sam_drafts_never_cross_a_separator(documents, context, match_type, d):
    corpus = make_corpus(match_type, max_trie_depth=4, draft_token_num=d,
                         external_sam_budget=d - 1, sams={"a": make_sam(*documents)})
    result = corpus.match_tree("k", context, len(context))
    tree = check_tree(result.token_ids, result.parents, d - 1)
    assert SEPARATOR not in tree.token_ids
    assert all(s == CORPUS for s in result.sources[1:])  # the trie is empty
    for path in tree.paths():
        assert any(occurs(context[-k:] + path, documents) for k in range(1, 5))


@settings(max_examples=60, deadline=None)
@given(windows=st.lists(tokens_st, min_size=1, max_size=10), depth=st.integers(2, 5),
       extra=st.integers(1, 12))
def test_eviction_respects_capacity_and_removes_only_leaves(windows, depth, extra):
    trie = SGLangTrie(capacity=depth + extra, max_depth=depth)
    for window in windows:
        trie.insert(window)
        assert trie.num_nodes <= trie.capacity
        live = trie.lru_order()
        position = {node: i for i, node in enumerate(live)}
        for node in live:  # every ancestor sits in front of its descendants (tail = leaf)
            parent = trie.parent(node)
            assert parent == trie.root or position[parent] < position[node]
    live = trie.lru_order()
    count = min(len(live), 3)
    removed = live[len(live) - count:][::-1]  # tail first, the order squeeze evicts in
    trie.squeeze(count)
    remaining = trie.lru_order()
    assert remaining == live[:len(live) - count]
    for i, node in enumerate(removed):  # a leaf when evicted: no later or surviving child
        assert all(trie.parent(other) != node for other in remaining + removed[i + 1:])


@settings(max_examples=50, deadline=None)
@given(windows=st.lists(tokens_st, max_size=6), stream=st.lists(st.integers(0, 5), min_size=2,
       max_size=20), steps=st.lists(st.integers(1, 3), min_size=1, max_size=8),
       match_type=st.sampled_from(["BFS", "PROB"]))
def test_incremental_equals_stateless_property(windows, stream, steps, match_type):
    corpus = make_corpus(match_type, max_trie_depth=4, draft_token_num=6, max_bfs_breadth=3)
    corpus.batch_put(windows)
    end = 1
    for step in steps:
        end = min(len(stream), end + step)
        tail = stream[max(0, end - 4):end]
        assert get_with_state(corpus, "req", tail, end) == corpus.batch_get(
            [f"f{end}"], [tail], [end])


# ---------------------------------------------------------------------------------- drafter


def run_stream(drafter: SGLangDrafter, prompt: list[int], output: list[int], budget: int = 7):
    """Replay `output` greedily: accept the longest drafted prefix, plus one bonus token."""
    drafter.start("r", prompt)
    trees, pos = [], 0
    while pos < len(output):
        tree = drafter.propose(["r"], [budget])[0]
        trees.append(tree)
        accepted = tree.accepted_nodes(output[pos:])
        step = output[pos:pos + len(accepted) + 1]
        drafter.commit("r", step)
        pos += len(step)
    drafter.stop("r")
    return trees


def test_drafter_trees_are_unpadded_and_monotone() -> None:
    for match_type in ("BFS", "PROB"):
        drafter = SGLangDrafter(SGLangParams(match_type=match_type, draft_token_num=8))
        stream = [1, 2, 3, 4, 5] * 6
        trees = run_stream(drafter, [9, 1, 2], stream)
        for tree in trees:
            assert tree.num_drafts <= 7
            assert all(a >= b for a, b in zip(tree.probs, tree.probs[1:]))
            assert all(tree.probs[p] >= tree.probs[i] for i, p in enumerate(tree.parents) if i)
            assert all(s == TRIE for s in tree.sources[1:])
        assert trees[0].num_drafts == 0  # the prompt is not indexed
        assert max(t.num_drafts for t in trees) > 0
        stats = drafter.stats()["trie"]
        assert 0 < stats["accepted"] <= stats["drafted"]


def test_drafter_matches_raw_corpus_protocol() -> None:
    # Each decode step = batch_get(context) then batch_put(context); the prefill token is
    # committed without a proposal and inserts nothing.
    params = SGLangParams(draft_token_num=6, max_trie_depth=5, capacity=1000)
    drafter, corpus = SGLangDrafter(params), SGLangCorpus(params)
    history = [7, 8, 1, 2]
    drafter.start("r", list(history))
    drafter.commit("r", [3])
    history.append(3)
    assert drafter.corpus.trie.num_nodes == 1
    for token in [1, 2, 3, 1, 2, 3, 4, 1, 2]:
        tree = drafter.propose(["r"], [10])[0]
        tokens, _ = corpus.batch_get(["r"], [history[-5:]], [len(history)])
        assert tree.token_ids == tokens[:len(tree)] and set(tokens[len(tree):]) <= {0}
        corpus.batch_put([history[-5:]])
        drafter.commit("r", [token])
        history.append(token)


def test_drafter_budget_insert_prompt_and_determinism() -> None:
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    faithful = SGLangDrafter(SGLangParams(draft_token_num=8))
    faithful.start("a", prompt)
    assert faithful.propose(["a"], [7])[0].num_drafts == 0
    peer = SGLangDrafter(SGLangParams(draft_token_num=8), insert_prompt=True)
    peer.start("a", prompt)
    tree = peer.propose(["a"], [7])[0]
    assert tree.token_ids[:2] == [6, 7] and tree.num_drafts > 0
    assert peer.propose(["a"], [2])[0].num_drafts <= 2
    assert peer.propose(["a"], [0])[0].num_drafts == 0
    stream = [1, 2, 3, 1, 2, 4, 1, 2, 3] * 3
    first = run_stream(SGLangDrafter(SGLangParams(draft_token_num=8)), [1, 2], stream)
    second = run_stream(SGLangDrafter(SGLangParams(draft_token_num=8)), [1, 2], stream)
    assert first == second


class _Corpora:
    def __init__(self, sams: dict) -> None:
        self.sams = sams

    def snapshot(self) -> dict:
        return dict(self.sams)


def test_drafter_uses_sams_and_reset_keeps_them() -> None:
    corpora = _Corpora({"docs": make_sam([1, 2, 3, 20, 21])})
    drafter = SGLangDrafter(SGLangParams(draft_token_num=6, external_sam_budget=2), corpora)
    drafter.start("r", [1, 2, 3])
    tree = drafter.propose(["r"], [5])[0]
    assert [3, 20, 21] in [[3, *p] for p in tree.paths()]
    assert set(tree.sources[1:]) == {CORPUS}
    drafter.commit("r", [20, 21])
    drafter.reset()
    assert drafter.corpus.trie.num_nodes == 1 and "docs" in drafter.corpus.sams
    drafter.stop("r")
    with pytest.raises(KeyError):
        drafter.propose(["r"], [5])


def test_drafter_accepts_drafter_config() -> None:
    from ngramspec.drafting.config import DrafterConfig
    from ngramspec.drafting.factory import make_drafter

    config = DrafterConfig.sglang(draft_token_num=8, match_type="PROB", capacity=1000)
    drafter = make_drafter(config)
    assert isinstance(drafter, SGLangDrafter)
    assert drafter.params.match_type == "PROB" and drafter.params.draft_token_num == 8
    assert drafter.params.insert_prompt is False  # faithful unless asked explicitly


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SGLangParams(capacity=18, max_trie_depth=18)  # SGLang crashes here (#36495)
    with pytest.raises(ValueError, match="match_type"):
        SGLangParams(match_type="DFS")
    with pytest.raises(ValueError, match="max_bfs_breadth"):
        SGLangParams(min_bfs_breadth=3, max_bfs_breadth=2)
