"""Property tests: every tree NgramDrafter proposes is valid, best-first and deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.drafter import NgramDrafter
from ngramspec.drafting.index.sam import SEPARATOR, SuffixAutomaton
from ngramspec.drafting.sources import CONTEXT, CORPUS, TRIE
from ngramspec.drafting.tree import DraftBatch, DraftTree


class Corpora:
    def __init__(self, docs: list[list[int]]) -> None:
        self.sams = {}
        if any(docs):
            sam = SuffixAutomaton()
            for doc in docs:
                sam.add_document(doc)
            sam.finalize()
            self.sams["c"] = sam

    def snapshot(self) -> dict[str, SuffixAutomaton]:
        return self.sams


tok = st.integers(0, 5)
scenario = st.fixed_dictionaries({
    "prompts": st.lists(st.lists(tok, min_size=1, max_size=20), min_size=1, max_size=3),
    "refs": st.lists(st.lists(tok, max_size=10), max_size=2),
    "docs": st.lists(st.lists(tok, min_size=1, max_size=15), max_size=3),
    "steps": st.lists(st.tuples(st.integers(0, 2), st.lists(tok, min_size=1, max_size=4),
                                st.integers(0, 15)), max_size=12),
    "capacity": st.integers(20, 200),
})


def run(sc: dict) -> tuple[list[DraftTree], list[list[int]], list[list[int]]]:
    cfg = DrafterConfig(capacity=sc["capacity"], max_trie_depth=6, max_context_match=5,
                        max_sam_match=5, draft_token_num=12)
    drafter = NgramDrafter(cfg, Corpora(sc["docs"]))
    ids = [f"r{i}" for i in range(len(sc["prompts"]))]
    texts = [list(p) for p in sc["prompts"]]
    for rid, prompt in zip(ids, sc["prompts"]):
        drafter.start(rid, prompt, references=sc["refs"])
    trees, budgets = [], []
    for who, tokens, budget in sc["steps"]:
        i = who % len(ids)
        (tree,) = drafter.propose([ids[i]], [budget])
        trees.append(tree)
        budgets.append(budget)
        assert tree.token_ids[0] == texts[i][-1]
        drafter.commit(ids[i], tokens)
        texts[i].extend(tokens)
    return trees, budgets, texts


def check_tree(tree: DraftTree, budget: int) -> None:
    n = len(tree)
    assert 1 <= n <= 1 + min(budget, 11)
    assert tree.parents[0] == -1 and tree.probs[0] == 1.0 and tree.sources[0] == -1
    seen = set()
    for i in range(1, n):
        p = tree.parents[i]
        assert 0 <= p < i
        assert (p, tree.token_ids[i]) not in seen  # no duplicate siblings
        seen.add((p, tree.token_ids[i]))
        assert 0.0 < tree.probs[i] <= tree.probs[p]  # a path is no likelier than its prefix
        assert tree.probs[i] <= tree.probs[i - 1] + 1e-12  # best-first order
        assert tree.sources[i] in (CONTEXT, TRIE, CORPUS)
        assert tree.token_ids[i] != SEPARATOR
    for k in range(n):  # every prefix is itself a valid tree
        DraftTree(*[a[:k + 1] for a in (tree.token_ids, tree.parents, tree.probs, tree.sources)])


@settings(max_examples=60, deadline=None)
@given(scenario)
def test_every_tree_is_valid_and_best_first(sc):
    trees, budgets, _ = run(sc)
    for tree, budget in zip(trees, budgets):
        check_tree(tree, budget)


@settings(max_examples=25, deadline=None)
@given(scenario)
def test_same_inputs_same_trees(sc):
    a, _, _ = run(sc)
    b, _, _ = run(sc)
    assert [(t.token_ids, t.parents, t.probs, t.sources) for t in a] == [
        (t.token_ids, t.parents, t.probs, t.sources) for t in b
    ]


def occurs_in_one_document(path: list[int], docs: list[list[int]]) -> bool:
    n = len(path)
    return any(d[i : i + n] == path for d in docs for i in range(len(d) - n + 1))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(tok, min_size=1, max_size=12), min_size=1, max_size=3),
       st.lists(tok, min_size=1, max_size=8))
def test_corpus_drafts_never_cross_a_document_separator(docs, prompt):
    # Only the corpus can propose here: the prompt is tiny and the trie knows only the prompt.
    drafter = NgramDrafter(DrafterConfig(max_sam_match=6), Corpora(docs))
    drafter.start("r", prompt)
    (tree,) = drafter.propose(["r"], [11])
    for i in range(1, len(tree)):
        if tree.sources[i] != CORPUS:
            continue
        path = [tree.token_ids[j] for j in tree.path_to(i)]
        # The matched suffix ends with the root token; root + path lies inside one document.
        assert occurs_in_one_document([prompt[-1]] + path, docs)


# ---- DraftBatch: the trees as arrays ------------------------------------------------------------

def random_tree(draw: st.DrawFn, max_nodes: int = 12) -> DraftTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    probs = sorted((draw(st.floats(0.0, 1.0)) for _ in range(n - 1)), reverse=True)
    return DraftTree([draw(st.integers(0, 50_000)) for _ in range(n)], parents, [1.0] + probs,
                     [-1] + [draw(st.integers(0, 2)) for _ in range(n - 1)])


trees_lists = st.lists(st.composite(random_tree)(), max_size=6)


def as_tuple(tree: DraftTree) -> tuple:
    return tree.token_ids, tree.parents, tree.probs, tree.sources


@given(trees_lists, st.integers(1, 14), st.data())
@settings(max_examples=100, deadline=None)
def test_draft_batch_round_trips_and_cuts_prefixes(trees, min_width, data):
    batch = DraftBatch.from_trees(trees, min_width)
    assert batch.width >= min_width
    assert [as_tuple(t) for t in batch] == [as_tuple(t) for t in trees]
    assert batch.sizes.tolist() == [len(t) for t in trees]
    sizes = [data.draw(st.integers(1, len(t))) for t in trees]
    got = batch.prefixes(sizes)
    assert [as_tuple(t) for t in got] == [as_tuple(t.prefix(k - 1)) for t, k in zip(trees, sizes)]
    for i, tree in enumerate(trees):
        assert as_tuple(batch.tree(i)) == as_tuple(tree)
    if trees:  # a replaced row is cut to the width, best-first
        wide = data.draw(st.composite(random_tree)(max_nodes=20))
        batch.replace(0, wide)
        assert as_tuple(batch[0]) == as_tuple(wide.prefix(batch.width - 1))
        with pytest.raises(ValueError, match="at most each tree's size"):
            batch.prefixes([batch.width + 1] + sizes[1:])


@given(scenario)
@settings(max_examples=30, deadline=None)
def test_drafter_batch_rows_are_its_trees(sc):
    """The kernel writes only a tree's own columns: the batch read row by row, whole, or cut
    gives the same trees."""
    cfg = DrafterConfig(capacity=sc["capacity"], max_trie_depth=6, draft_token_num=12)
    drafter = NgramDrafter(cfg, Corpora(sc["docs"]))
    ids = [f"r{i}" for i in range(len(sc["prompts"]))]
    for rid, prompt in zip(ids, sc["prompts"]):
        drafter.start(rid, prompt, references=sc["refs"])
    for who, tokens, budget in sc["steps"]:
        batch = drafter.propose(ids, [budget] * len(ids))
        assert isinstance(batch, DraftBatch) and batch.width == cfg.draft_token_num
        whole = [as_tuple(t) for t in batch.trees()]
        assert [as_tuple(batch.tree(i)) for i in range(len(ids))] == whole
        assert [as_tuple(t) for t in batch.prefixes(batch.sizes.tolist())] == whole
        for t in batch:
            check_tree(DraftTree(*as_tuple(t)), budget)
        drafter.commit(ids[who % len(ids)], tokens)
