"""NgramDrafter behaviour: prompt copy, corpora, separators, calibration, config, lifecycle."""

from __future__ import annotations

import pytest
from oracles.drafter import ReferenceDrafter

from ngramspec.drafting.config import DrafterConfig
from ngramspec.drafting.drafter import NgramDrafter
from ngramspec.drafting.factory import make_drafter
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.sources import CONTEXT, CORPUS, TRIE

# Behaviour tests run on the production drafter and on its pure-Python reference.
backends = pytest.mark.parametrize("backend", ["reference", "production"])


def new_drafter(backend: str, corpora: object = None, **overrides: object) -> NgramDrafter:
    cls = NgramDrafter if backend == "production" else ReferenceDrafter
    return cls(DrafterConfig(**overrides), corpora)  # type: ignore[arg-type, return-value]


class StubCorpora:
    def __init__(self, docs_by_name: dict[str, list[list[int]]]) -> None:
        self.sams = {}
        for name, docs in docs_by_name.items():
            sam = SuffixAutomaton()
            for doc in docs:
                sam.add_document(doc)
            sam.finalize()
            self.sams[name] = sam

    def snapshot(self) -> dict[str, SuffixAutomaton]:
        return dict(self.sams)


def best_path(tree) -> list[int]:
    """Tokens along the first-child chain from the root (the most probable path)."""
    out, node = [], 0
    while True:
        kids = [i for i in range(1, len(tree)) if tree.parents[i] == node]
        if not kids:
            return out
        node = kids[0]
        out.append(tree.token_ids[node])


@backends
def test_copies_from_the_prompt_on_step_one(backend: str):
    # Prompt holds "a b c d e"; it ends with "a b" -> the first draft continues "c d e".
    a, b, c, d, e = 10, 11, 12, 13, 14
    drafter = new_drafter(backend)
    drafter.start("r", [a, b, c, d, e, 99, 98, a, b])
    (tree,) = drafter.propose(["r"], [11])
    assert tree.token_ids[0] == b
    assert best_path(tree)[:3] == [c, d, e]
    assert tree.sources[1] == CONTEXT


@backends
@pytest.mark.parametrize("wildcards", [1, 2])
def test_a_wildcard_match_copies_past_new_tokens(backend: str, wildcards: int):
    # "f ( a , X ) ;" earlier, "f ( a , Y" now: Y has no earlier occurrence, so the drafter
    # matches the tokens before it and copies what followed X: ") ;". With two wildcards the
    # new name may span two tokens (Y1 Y2 against X1 X2).
    f, lp, a, comma, rp, semi = 10, 11, 12, 13, 14, 15
    new = [40, 41][:wildcards]
    old = [30, 31][:wildcards]
    drafter = new_drafter(backend, max_wildcards=wildcards, trie_fallback=False)
    drafter.start("r", [f, lp, a, comma, *old, rp, semi, 99, f, lp, a, comma, *new])
    (tree,) = drafter.propose(["r"], [11])
    assert best_path(tree)[:2] == [rp, semi]
    assert tree.sources[1] == CONTEXT
    drafter.commit("r", [rp, semi, 7])  # the wildcard classes learn from it, apart
    calibration = drafter.stats()["calibration"]
    skip = calibration["context/skip/unique"]
    assert sum(skip["trials"]) == 3  # ")" and ";" accepted, the 99 under ";" rejected
    assert sum(r * t for r, t in zip(skip["accept_rate"], skip["trials"])) == pytest.approx(2)
    assert sum(calibration["context/unique"]["trials"]) == 0
    fewer = new_drafter(backend, max_wildcards=wildcards - 1, trie_fallback=False)
    fewer.start("r", [f, lp, a, comma, *old, rp, semi, 99, f, lp, a, comma, *new])
    (tree,) = fewer.propose(["r"], [11])
    assert tree.num_drafts == 0


@backends
def test_a_cursor_offers_no_continuation_that_cannot_be_placed(backend: str):
    # The context's X and Y (each 1 of 2 earlier "a": 1/3) fill the 2 nodes a budget of 2 can
    # take; the trie's X and Y (1 of 3 "a": 1/4) rank below both, so the trie cursor offers
    # neither and the nodes carry the context's evidence alone: only the context learns.
    a, x, y = 10, 11, 12
    drafter = new_drafter(backend)
    drafter.start("r", [a, x, 50, a, y, 51, a])
    (tree,) = drafter.propose(["r"], [2])
    assert sorted(tree.token_ids[1:]) == [x, y]
    assert set(tree.sources[1:]) == {CONTEXT}
    drafter.commit("r", [x, 50])
    calibration = drafter.stats()["calibration"]
    assert sum(calibration["context"]["trials"]) == 2  # X accepted, Y rejected
    assert sum(calibration["trie"]["trials"]) == 0
    # With a third node to fill, the trie's X still ranks among the best 3: it is offered
    # and merges into the context's X (the threshold, not the budget alone, cut it above).
    wider = new_drafter(backend)
    wider.start("r", [a, x, 50, a, y, 51, a])
    wider.propose(["r"], [3])
    wider.commit("r", [x, 50])
    assert sum(wider.stats()["calibration"]["trie"]["trials"]) > 0


@backends
def test_the_trie_fallback_offers_frequent_tokens_after_a_new_token(backend: str):
    # Nothing matches the new token 99; the trie's most frequent token (13) comes first, as a
    # match of length 0, and under it only its most frequent follower (1; not 2 or 3).
    drafter = new_drafter(backend, max_wildcards=0)
    drafter.start("a", [1, 13, 1, 13, 2, 13, 3])
    drafter.stop("a")
    drafter.start("b", [99])
    (tree,) = drafter.propose(["b"], [11])
    assert tree.token_ids[1] == 13 and tree.sources[1] == TRIE
    assert [tree.token_ids[i] for i in range(2, len(tree)) if tree.parents[i] == 1] == [1]
    off = new_drafter(backend, max_wildcards=0, trie_fallback=False)
    off.start("a", [1, 13, 1, 13, 2, 13, 3])
    off.start("b", [99])
    (tree,) = off.propose(["b"], [11])
    assert tree.num_drafts == 0


@backends
def test_copies_from_a_reference_document(backend: str):
    drafter = new_drafter(backend)
    drafter.start("r", [7, 1, 2], references=[[5, 1, 2, 3, 4]])
    (tree,) = drafter.propose(["r"], [5])
    assert best_path(tree)[:2] == [3, 4]


@backends
def test_learns_across_requests_through_the_trie(backend: str):
    # (4 is new to request b, so without trie_fallback=False the most frequent tokens, at an
    # untrained 2/10 each, would outrank 6 after 5, at 1/3 * 1/2.)
    drafter = new_drafter(backend, trie_fallback=False)
    drafter.start("a", [1, 2, 3, 4, 5, 6])
    drafter.stop("a")
    drafter.start("b", [9, 3, 4])
    (tree,) = drafter.propose(["b"], [3])
    assert best_path(tree) == [5, 6]
    assert tree.sources[1] == TRIE


@backends
def test_external_corpus_drafts_and_never_crosses_a_separator(backend: str):
    corpora = StubCorpora({"docs": [[1, 2, 3], [4, 5, 6]]})
    drafter = new_drafter(backend, corpora)
    drafter.start("r", [8, 1, 2])
    (tree,) = drafter.propose(["r"], [11])
    assert best_path(tree) == [3]  # "1 2 3" then the document ends: no "4 5 6"
    assert tree.sources[1] == CORPUS
    drafter.start("s", [9, 5])
    (tree,) = drafter.propose(["s"], [11])
    assert best_path(tree) == [6]


@backends
def test_corpus_continues_only_under_nodes_it_won(backend: str):
    # The request and the corpus both continue "1 2" with 3; the request wins node 3 (first
    # seen on a tie), so the corpus's "3 -> 9" is not offered under it. The corpus still
    # drafts under the root and under its own nodes (the other corpus tests).
    corpora = StubCorpora({"docs": [[1, 2, 3, 9, 9, 9]]})
    drafter = new_drafter(backend, corpora)
    drafter.start("r", [1, 2, 3, 4, 50, 51, 1, 2])
    (tree,) = drafter.propose(["r"], [11])
    three = tree.token_ids.index(3)
    assert tree.parents[three] == 0 and tree.sources[three] != CORPUS
    assert 9 not in tree.token_ids
    for i in range(1, len(tree)):
        if tree.sources[i] == CORPUS:
            parent = tree.parents[i]
            assert parent == 0 or tree.sources[parent] == CORPUS


@backends
def test_corpus_added_later_is_used_and_match_is_incremental(backend: str):
    corpora = StubCorpora({})
    drafter = new_drafter(backend, corpora, trie_fallback=False)  # 1 is new: no trie drafts
    drafter.start("r", [8, 1])
    (tree,) = drafter.propose(["r"], [4])
    assert len(tree) == 1
    corpora.sams = StubCorpora({"x": [[1, 2, 3, 4, 5]]}).sams
    (tree,) = drafter.propose(["r"], [4])
    assert best_path(tree) == [2, 3, 4, 5]
    drafter.commit("r", [2, 3])
    (tree,) = drafter.propose(["r"], [4])
    assert best_path(tree) == [4, 5]


@backends
def test_budget_caps_the_tree_and_zero_budget_gives_the_root(backend: str):
    drafter = new_drafter(backend, draft_token_num=4)
    drafter.start("r", [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2])
    (small, capped, none) = drafter.propose(["r", "r", "r"], [2, 50, 0])
    assert small.num_drafts == 2
    assert capped.num_drafts == 3  # draft_token_num - 1
    assert none.num_drafts == 0 and none.token_ids == [2]


@backends
def test_calibration_raises_estimates_when_drafts_are_accepted(backend: str):
    drafter = new_drafter(backend)
    period = [3, 1, 4, 1, 5, 9, 2, 6]
    drafter.start("r", period * 2)
    (first,) = drafter.propose(["r"], [11])
    stream = period * 80
    pos = 0
    for _ in range(40):
        (tree,) = drafter.propose(["r"], [11])
        accepted = [tree.token_ids[i] for i in tree.accepted_nodes(stream[pos : pos + 12])]
        step = accepted + [stream[pos + len(accepted)]]  # drafts + the bonus token
        drafter.commit("r", step)
        pos += len(step)
    (last,) = drafter.propose(["r"], [11])
    assert last.probs[1] > first.probs[1]
    stats = drafter.stats()
    assert stats["sources"]["context"]["accepted"] > 0
    assert sum(stats["calibration"]["context"]["trials"]) > 0


@backends
def test_a_unique_match_is_calibrated_apart_from_a_shared_one(backend: str):
    """One earlier occurrence of a long suffix (raw 1/2) and a split between several (raw 1/3
    each here) learn separate factors: copying a unique 200-token prompt teaches the unique
    class, and a later request whose 16-token suffix occurred twice still gets its untrained
    estimate. With one class per (source, length) it would inherit the copy's raised factor.
    Prompts stay out of the trie so that the second tree's estimates are the context's alone."""
    drafter = new_drafter(backend, insert_prompt=False)
    unique = list(range(1000, 1200))
    drafter.start("copy", unique)
    drafter.commit("copy", unique[:1])
    pos = 1
    while pos < len(unique):
        (tree,) = drafter.propose(["copy"], [11])
        accepted = [tree.token_ids[i] for i in tree.accepted_nodes(unique[pos:pos + 11])]
        step = (accepted + unique[pos + len(accepted):])[:len(accepted) + 1]
        drafter.commit("copy", step)
        pos += len(step)
    drafter.stop("copy")
    calibration = drafter.stats()["calibration"]
    assert max(calibration["context/unique"]["factor"]) > 1.4
    assert sum(calibration["context"]["trials"]) == 0
    shared = list(range(2000, 2016))  # a 16-token suffix seen twice, followed by 7 and by 8
    drafter.start("shared", shared + [7] + shared + [8] + shared)
    (tree,) = drafter.propose(["shared"], [2])
    assert sorted(tree.token_ids[1:]) == [7, 8]
    assert tree.probs[1] == pytest.approx(1 / 3)  # raw 1/(2 + 1), factor still 1


@backends
def test_deterministic(backend: str):
    def run() -> list:
        drafter = new_drafter(backend, StubCorpora({"c": [[1, 2, 3, 1, 2, 4]]}))
        drafter.start("a", [1, 2, 3, 1, 2, 4, 1, 2])
        drafter.start("b", [2, 1, 2])
        out = []
        for step in range(5):
            trees = drafter.propose(["a", "b"], [11, 6])
            out.append([(t.token_ids, t.parents, t.probs, t.sources) for t in trees])
            drafter.commit("a", [step % 3 + 1])
            drafter.commit("b", [2, step % 4])
        return out

    assert run() == run()


@backends
def test_commits_reach_the_trie_before_any_reader_even_after_stop(backend: str):
    # The production drafter queues commits until the next propose (kernels/drafter.cpp): reading
    # the trie, or a stopped request's last commit, must still see them.
    drafter = new_drafter(backend)
    drafter.start("a", [1, 2, 3])
    drafter.commit("a", [4, 5])
    drafter.start("b", [7, 8])
    drafter.commit("b", [9])
    drafter.stop("b")
    assert drafter.trie.lookup([3, 4, 5]) >= 0
    assert drafter.trie.lookup([7, 8, 9]) >= 0
    assert drafter.stats()["num_requests"] == 1


def test_many_queued_commits_grow_the_context_like_eager_ones():
    # Hundreds of tokens committed with no propose between: the context index grows (arrays and
    # hash table) while its appends wait in the queue; the trees must still equal the reference's.
    distinct = [(i * 7919) % 1009 + 1 for i in range(600)]  # every window new: the table fills
    tokens = distinct + distinct[100:150]  # then a repeat to copy from
    trees = []
    for backend in ("reference", "production"):
        drafter = new_drafter(backend)
        drafter.start("r", tokens[:5])
        drafter.start("s", tokens[3:9])
        for at in range(5, len(tokens), 50):
            drafter.commit("r", tokens[at:at + 50])
            drafter.commit("s", tokens[at + 1:at + 40])
        out = drafter.propose(["r", "s"], [11, 11])
        trees.append([(t.token_ids, t.parents, t.sources) for t in out])
    assert trees[0] == trees[1]
    assert all(len(t[0]) > 1 for t in trees[1])


@backends
def test_reset_clears_learning_but_keeps_corpora(backend: str):
    corpora = StubCorpora({"c": [[1, 2, 3]]})
    drafter = new_drafter(backend, corpora)
    drafter.start("a", [4, 5, 6, 4, 5])
    drafter.reset()
    assert drafter.trie.num_nodes == 1
    with pytest.raises(KeyError):
        drafter.propose(["a"], [3])
    drafter.start("b", [1, 2])
    (tree,) = drafter.propose(["b"], [3])
    assert best_path(tree) == [3]


@backends
def test_lifecycle_errors(backend: str):
    drafter = new_drafter(backend)
    drafter.start("a", [1])
    with pytest.raises(ValueError):
        drafter.start("a", [1])
    with pytest.raises(ValueError):
        drafter.start("b", [])
    with pytest.raises(ValueError):
        drafter.propose(["a"], [])
    drafter.stop("a")
    drafter.stop("a")  # idempotent


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"preset": "vllm"}, "preset"),
        ({"match_type": "DFS"}, "match_type"),
        ({"draft_token_num": 0}, "draft_token_num"),
        ({"max_trie_depth": 1}, "max_trie_depth"),
        ({"min_bfs_breadth": 0}, "min_bfs_breadth"),
        ({"min_bfs_breadth": 5, "max_bfs_breadth": 4}, "max_bfs_breadth"),
        ({"capacity": 18, "max_trie_depth": 18}, "capacity"),  # == max_trie_depth: SGLang #36495 crash
        ({"external_sam_budget": 12}, "external_sam_budget"),
        ({"external_corpus_max_tokens": 0}, "external_corpus_max_tokens"),
        ({"max_context_match": 0}, "max_context_match"),
        ({"request_gain_prior": -1.0}, "request_gain_prior"),
        ({"request_gain_decay": 0.0}, "request_gain_decay"),
        ({"min_path_prob": 1.0}, "min_path_prob"),
        ({"max_wildcards": -1}, "max_wildcards"),
        ({"max_wildcards": 5}, "max_wildcards"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"DrafterConfig\.{field} "):
        DrafterConfig(**kwargs)


def test_sglang_defaults_and_make_drafter():
    cfg = DrafterConfig.sglang()
    assert (cfg.preset, cfg.draft_token_num, cfg.max_trie_depth) == ("sglang", 12, 18)
    assert (cfg.min_bfs_breadth, cfg.max_bfs_breadth, cfg.match_type) == (1, 10, "BFS")
    assert (cfg.capacity, cfg.external_sam_budget) == (10_000_000, 0)
    assert cfg.num_draft_tokens == 11
    assert DrafterConfig.sglang(match_type="PROB").match_type == "PROB"
    with pytest.raises(ValueError):
        DrafterConfig.sglang(capacity=3)
    with pytest.raises(ValueError):
        DrafterConfig.sglang(nonsense=1)
    assert type(make_drafter(DrafterConfig())) is NgramDrafter
    assert type(make_drafter(cfg)).__name__ == "SGLangDrafter"
    with pytest.raises(ValueError, match="'ngramspec' preset"):
        NgramDrafter(cfg)


def test_a_bad_commit_is_a_clear_error_and_the_others_are_kept():
    drafter = new_drafter("production")
    drafter.start("good", [1, 2, 3])
    drafter.start("bad", [4, 5])
    drafter.commit("good", [1, 2])
    drafter.commit("bad", [2**40])
    with pytest.raises(ValueError, match="bad"):
        drafter.propose(["good"], [3])
    (tree,) = drafter.propose(["good"], [3])  # the queue kept the good commit
    assert drafter.trie.lookup([3, 1, 2]) >= 0
    assert tree.token_ids[0] == 2
    drafter.commit("bad", [1.5])  # not truncated to 1: refused
    with pytest.raises(ValueError, match="bad"):
        drafter.propose(["good"], [3])
    with pytest.raises(ValueError, match="budgets must be int64 integers"):
        drafter.propose(["good"], [2.0])
    assert len(drafter.propose(["good", "bad"], [3, 3])) == 2  # still serving both


def copy_run(drafter, request_id: str, text: list[int], steps: int) -> None:
    """Start a request on `text`'s first half and let it copy the second half, verify step by
    verify step, as greedy decoding would accept it."""
    half = len(text) // 2
    drafter.start(request_id, text[:half] + text[:1])
    future = text[1:]
    drafter.commit(request_id, future[:1])
    pos = 1
    for _ in range(steps):
        (tree,) = drafter.propose([request_id], [11])
        accepted = [tree.token_ids[i] for i in tree.accepted_nodes(future[pos:pos + 11])]
        step = future[pos:pos + len(accepted) + 1]
        drafter.commit(request_id, step)
        pos += len(step)


@backends
def test_a_request_that_keeps_accepting_gets_a_higher_gain(backend: str):
    """The request gain (calibration.py): a request whose recent drafts were accepted more
    often than estimated scales its estimates up, into one deep chain. Compared with the same
    run without the gain."""
    text = [50 + (7 * i) % 23 for i in range(40)] * 2  # two copies of a 40-token text
    trees = {}
    for prior in (1.0, 0.0):
        drafter = new_drafter(backend, request_gain_prior=prior)
        copy_run(drafter, "copier", text, 3)
        (copier,) = drafter.propose(["copier"], [11])
        trees[prior] = copier
    with_gain, without = trees[1.0], trees[0.0]
    assert with_gain.token_ids[:8] == without.token_ids[:8]  # the copy's next tokens
    assert with_gain.probs[1] > without.probs[1]
    assert max(with_gain.depths()) == 11 > max(without.depths())  # one chain: the copy


@backends
def test_the_request_gain_is_kept_per_source(backend: str):
    """Copying the prompt, the context wins the accepted drafts: its gain rises; the corpus,
    which won no judged node, keeps gain 1 (one gain shared by the sources would raise it too).
    A new request starts at 1 everywhere."""
    corpora = StubCorpora({"c": [[900, 901, 902]]})
    drafter = new_drafter(backend, corpora, insert_prompt=False)
    copy_run(drafter, "copier", [50 + (7 * i) % 23 for i in range(40)] * 2, 3)
    gains = drafter.request_gains("copier")
    assert gains["context"] > 1.5
    assert gains["corpus"] == 1.0
    drafter.start("fresh", [1, 2, 3])
    assert drafter.request_gains("fresh") == {"context": 1.0, "trie": 1.0, "corpus": 1.0}


def test_the_request_gain_lifts_replayed_acceptance():
    """On the recorded streams (data/streams), turning off the request gain lowers mean
    accepted tokens per step (replays are exact and deterministic)."""
    from pathlib import Path

    from ngramspec.simulator.replay import read_streams, simulate

    root = Path(__file__).resolve().parent.parent
    streams = read_streams(sorted((root / "data/streams").glob("*.jsonl")))

    def accepted(**overrides: object) -> float:
        drafter = NgramDrafter(DrafterConfig(**overrides))
        return simulate(drafter, streams, budget=11).overall.mean_accepted

    assert accepted() > accepted(request_gain_prior=0.0)


def test_path_estimates_are_calibrated_on_replayed_streams():
    """The speculation policy prices the drafter's path estimates as they are (no engine-side
    correction), so on real model outputs they must be right on average: in every band of
    estimates that holds enough nodes, the acceptance observed over full trees is within 25% of
    the estimated, and within 10% over all nodes (replays are exact and deterministic)."""
    from pathlib import Path

    from ngramspec.simulator.replay import read_streams

    root = Path(__file__).resolve().parent.parent
    streams = read_streams(sorted((root / "data/streams").glob("*.jsonl")))
    drafter = NgramDrafter(DrafterConfig())
    bands = [[0.0, 0, 0] for _ in range(10)]  # per 0.1-wide band: estimates, accepted, nodes
    for s in streams:
        drafter.start(s.id, s.prompt_ids)
        drafter.commit(s.id, s.output_ids[:1])
        pos = 1
        while pos < len(s.output_ids):
            (tree,) = drafter.propose([s.id], [11])
            accepted = set(tree.accepted_nodes(s.output_ids[pos:pos + tree.num_drafts]))
            for node in range(1, len(tree)):
                band = bands[min(int(tree.probs[node] * 10), 9)]
                band[0] += tree.probs[node]
                band[1] += node in accepted
                band[2] += 1
            emitted = s.output_ids[pos:pos + len(accepted) + 1]
            drafter.commit(s.id, emitted)
            pos += len(emitted)
        drafter.stop(s.id)
    ratios = [accepted / estimated for estimated, accepted, nodes in bands if nodes >= 300]
    assert len(ratios) >= 6 and all(0.75 < r < 1.25 for r in ratios), ratios
    total = sum(b[1] for b in bands) / sum(b[0] for b in bands)
    assert 0.9 < total < 1.1


@backends
def test_reset_calibration_keeps_the_ngram_statistics(backend: str):
    drafter = new_drafter(backend)
    text = list(range(100, 120))
    drafter.start("r", text + text[:3])
    for token in text[3:9]:  # copies that are accepted: the calibration learns
        drafter.propose(["r"], [4])
        drafter.commit("r", [token])
    learned = drafter.stats()["calibration"]
    nodes = drafter.trie.num_nodes
    drafter.reset_calibration()
    assert drafter.stats()["calibration"] != learned
    assert drafter.stats()["calibration"] == new_drafter(backend).stats()["calibration"]
    assert drafter.trie.num_nodes == nodes
    (tree,) = drafter.propose(["r"], [4])
    assert tree.token_ids[1] == text[9]  # the request still copies its own text


def test_wildcards_and_the_trie_fallback_lift_replayed_acceptance():
    """On the recorded streams (data/streams), each of them raises mean accepted tokens per
    step, and together more than either (replays are exact and deterministic)."""
    from pathlib import Path

    from ngramspec.simulator.replay import read_streams, simulate

    root = Path(__file__).resolve().parent.parent
    streams = read_streams(sorted((root / "data/streams").glob("*.jsonl")))

    def accepted(**overrides: object) -> float:
        drafter = NgramDrafter(DrafterConfig(**overrides))
        return simulate(drafter, streams, budget=11).overall.mean_accepted

    neither = accepted(max_wildcards=0, trie_fallback=False)
    wildcards, fallback = accepted(trie_fallback=False), accepted(max_wildcards=0)
    assert neither < min(wildcards, fallback)
    assert max(wildcards, fallback) < accepted()


@backends
def test_a_node_matched_by_the_bonus_token_had_its_children_unjudged(backend: str):
    """The engine may verify only a prefix of the tree; its bonus token can then match a node
    it cut. That node counts as accepted, but its children were never verified. Here the tree
    is one chain (a unique 5-token match: raw 1/2, factor 1), nothing is verified and the bonus
    is node 1's token: the context gain learns node 1 alone, (1 + 1) / (0.5 + 1); counting
    node 2 as rejected would give (1 + 1) / (0.5 + 0.5 + 1) = 1."""
    drafter = new_drafter(backend, insert_prompt=False)
    text = list(range(100, 130))
    drafter.start("r", text + text[:5])
    (tree,) = drafter.propose(["r"], [11])
    assert tree.token_ids[1:4] == [105, 106, 107] and tree.parents[1:4] == [0, 1, 2]
    drafter.commit("r", [105])
    assert drafter.request_gains("r")["context"] == pytest.approx(2 / 1.5)


def test_a_batch_still_held_is_never_written_again():
    """A batch, or a view of one, kept across proposes keeps its trees (each propose writes
    new arrays)."""
    a, b, c, d = 10, 11, 12, 13
    drafter = new_drafter("production")
    drafter.start("r", [a, b, c, d, 99, a, b, c, d, 98, a, b])
    first = drafter.propose(["r"], [11])
    kept = (first.ints.copy(), first.probs.copy())
    drafter.commit("r", [c, d])
    second = drafter.propose(["r"], [11])
    assert second.ints is not first.ints and second.probs is not first.probs
    assert (first.ints == kept[0]).all() and (first.probs == kept[1]).all()
    row = second.ints[0]  # a view holds its base
    kept_row = row.copy()
    del second
    drafter.commit("r", [99])
    third = drafter.propose(["r"], [11])
    assert third.ints is not row.base and (row == kept_row).all()
