"""NgramDrafter: one best-first draft tree over every n-gram source, built by numba kernels.

Sources (drafting/sources.py): the request's own context (references, prompt, output), the global
trie learned across requests, and every external corpus. Each source turns a matched suffix into
a cursor; a cursor lists continuation tokens with raw estimates `count / (occurrences + 1)`,
normalised within that source, which the calibrator turns into P(accepted | parent accepted) per
(source, matched length). All cursors feed ONE heap keyed by the estimated probability that the
whole path is accepted, so the tree is best-first: node i's path probability never exceeds that
of any earlier node (kernels/build.py has the walk).

Trie policy: the prompt and every committed token go into the global trie as soon as they are
known (count once), so concurrent requests sharing text help each other at once. The same
tokens are also in the request's own context, so both sources may propose the same token; such
candidates merge into one node that keeps the higher estimate (the two estimates are one piece
of evidence counted twice, so they are not combined as independent).

A propose is one kernel call per request and a commit one (learn from the pending tree, index
and count the new tokens). Per-request output arrays double as the pending tree, so nothing is
copied between propose and commit. tests/oracles/drafter.py is the pure-Python reference the
lockstep property tests hold this to, tree for tree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ngramspec.drafting.calibration import SourceCalibrator
from ngramspec.drafting.config import CorpusSnapshot, DrafterConfig
from ngramspec.drafting.index.context import ContextIndex
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.index.trie import NgramTrie, TrieState
from ngramspec.drafting.kernels import build as bk
from ngramspec.drafting.kernels import commit as cm
from ngramspec.drafting.kernels.sam import CorpusBank
from ngramspec.drafting.sources import NUM_SOURCES, SOURCE_NAMES
from ngramspec.drafting.tree import DraftTree


@dataclass(slots=True)
class _Layout:
    """What the kernels' buffers look like for one set of corpora (their count sizes them)."""

    bank: CorpusBank | None  # None: no external corpus
    key: tuple  # identity of the snapshot it was made from: (name, id(automaton)) pairs
    sams: list[SuffixAutomaton]  # held so that no id in `key` is reused while it lives
    scratch: bk.Scratch
    request_ints: int
    request_floats: int
    params: dict[int, np.ndarray]  # kernel parameters by budget
    snapshot: object = None  # the last snapshot seen to hold these corpora (identity check)


@dataclass(slots=True)
class _Request:
    context: ContextIndex  # references + separator + prompt + committed output
    trie_state: TrieState
    # The last built tree and its evidence (laid out as build.request_views says), with
    # trie_start and the nodes awaiting commit in the header of `ints`.
    ints: np.ndarray  # int64
    floats: np.ndarray  # float64: path probabilities first
    layout: _Layout  # the layout `ints`/`floats` follow
    params: np.ndarray  # the parameters of the last build (what its commit must read)
    matches: np.ndarray  # int64 [corpora, 3]: the request's match in each corpus (kernels/sam)

    @property
    def trie_start(self) -> int:
        """Where the request's own tokens begin in its context array (after any references)."""
        return int(self.ints[bk.R_TRIE_START])


class NgramDrafter:
    def __init__(self, config: DrafterConfig, corpora: CorpusSnapshot | None = None, *,
                 warm: bool = True) -> None:
        if config.preset != "ngramspec":
            raise ValueError(f"NgramDrafter serves the 'ngramspec' preset, not {config.preset!r}")
        if warm:
            warm_up()
        self.config = config
        self.corpora = corpora
        self.trie = NgramTrie(config.capacity, config.max_trie_depth)
        self.calibrator = SourceCalibrator(config.calibrate, config.calibration_prior_weight)
        self._requests: dict[str, _Request] = {}
        # Config values read on every step, kept as plain attributes (a request-step is ~15 µs,
        # so even property and method-call overheads show).
        self._nodes = config.num_draft_tokens + 1
        self._depth = config.max_trie_depth
        self._layout = self._new_layout({})
        self._current_layout()  # the corpus bank is built here, not in the first step
        self._counts = np.zeros(2 * NUM_SOURCES, np.int64)  # drafted, then accepted, by source

    # ----------------------------------------------------------------- lifecycle

    def start(
        self, request_id: str, prompt_ids: list[int], references: list[list[int]] | None = None
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token (the tree root)")
        cfg = self.config
        context = ContextIndex(cfg.max_context_match, cfg.max_context_occurrences)
        for doc in references or ():
            context.add_document(list(doc))
        trie_start = len(context)
        context.extend(prompt_ids)
        state = self.trie.new_state()
        if cfg.insert_prompt:
            self.trie.extend(state, context.tok, trie_start, len(context))
        layout = self._layout
        req = _Request(context, state, np.zeros(layout.request_ints, np.int64),
                       np.zeros(layout.request_floats, np.float64), layout,
                       self._params(layout, 0), _matches(layout))
        req.ints[bk.R_TRIE_START] = trie_start
        self._requests[request_id] = req

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        req = self._requests[request_id]
        new = np.asarray(accepted_token_ids, dtype=np.int32)
        ctx, trie, cal = req.context, self.trie, self.calibrator
        if req.trie_state.epoch != trie.epoch:  # a new trie: re-anchor on the request's tokens
            trie.anchors(req.trie_state, ctx.tok[req.trie_start:], len(ctx) - req.trie_start)
        ctx.reserve(len(new))
        trie.reserve(len(new) * self._depth)
        # One kernel call: learn from the pending tree, index the tokens, count them.
        failed = cm.commit(req.ints, req.floats, req.params, new, cal.cal, cal.prior,
                           self._counts, ctx.tok, ctx.prev, ctx.hashes, ctx.keys, ctx.lens,
                           ctx.vals, ctx.st, trie.cols, trie.edges, trie.runs, trie.meta,
                           req.trie_state.arr)
        if failed:
            raise RuntimeError("trie columns were not grown before extend (bug)")

    def stop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def reset(self) -> None:
        """Clear the trie, calibration and all request states; external corpora are kept."""
        self.trie.reset()
        self.calibrator.reset()
        self._requests.clear()
        self._counts[:] = 0

    # ----------------------------------------------------------------- proposing

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        if len(request_ids) != len(budgets):
            raise ValueError("request_ids and budgets must have the same length")
        layout = self._current_layout()
        cap = self._nodes - 1
        return [self._build(self._requests[rid], min(budget, cap), layout)
                for rid, budget in zip(request_ids, budgets)]

    def _current_layout(self) -> _Layout:
        """The layout of the corpora in use now (a new one when the snapshot changed)."""
        if self.corpora is None:
            return self._layout
        snapshot = self.corpora.snapshot()
        layout = self._layout
        if snapshot is layout.snapshot:  # the registry publishes a new mapping on every change
            return layout
        sams = dict(sorted(snapshot.items()))
        if _key(sams) != layout.key:
            layout = self._layout = self._new_layout(sams)
        layout.snapshot = snapshot
        return layout

    def _new_layout(self, sams: dict[str, SuffixAutomaton]) -> _Layout:
        cfg = self.config
        num_corpora = len(sams)
        scratch = bk.Scratch(cfg.num_draft_tokens, cfg.max_bfs_breadth,
                             cfg.max_anchors_per_source, cfg.max_context_occurrences, num_corpora)
        ints, floats = bk.request_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source,
                                        num_corpora)
        bank = CorpusBank(list(sams.values())) if sams else None
        return _Layout(bank, _key(sams), list(sams.values()), scratch, ints, floats, {})

    def _params(self, layout: _Layout, budget: int) -> np.ndarray:
        """The kernels' parameter array for `budget` under `layout` (cached there)."""
        params = layout.params.get(budget)
        if params is not None:
            return params
        cfg, s = self.config, layout.scratch
        num_corpora = layout.bank.num_corpora if layout.bank is not None else 0
        nodes, evidence = bk.tree_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source,
                                        num_corpora)
        params = np.array([budget, cfg.max_bfs_breadth, cfg.max_anchors_per_source,
                           cfg.max_context_occurrences, s.cursors, s.pool, s.groups, nodes,
                           evidence, cfg.max_context_match, int(cfg.calibrate),
                           cfg.max_sam_match], np.int64)
        layout.params[budget] = params
        return params

    def _build(self, req: _Request, budget: int, layout: _Layout) -> DraftTree:
        if req.layout is not layout:
            self._relayout(req, layout)
        s, trie, ctx = layout.scratch, self.trie, req.context
        if budget > 0 and req.trie_state.epoch != trie.epoch:
            trie.sync(req.trie_state)
        params = req.params = self._params(layout, budget)
        bank = layout.bank
        if bank is None:
            n = bk.build(trie.cols, trie.edges, trie.meta, req.trie_state.arr, ctx.tok, ctx.prev,
                         ctx.st, self.calibrator.cal, params, self.config.min_path_prob, s.ints,
                         s.floats, req.ints, req.floats, self._counts)
        else:
            n = bk.build_with_corpora(
                trie.cols, trie.edges, trie.meta, req.trie_state.arr, ctx.tok, ctx.prev, ctx.st,
                self.calibrator.cal, params, self.config.min_path_prob, s.ints, s.floats,
                req.ints, req.floats, self._counts, bank.states, bank.trans, bank.edges,
                bank.roots, req.matches)
        nodes = self._nodes
        flat = req.ints[bk.R_HEAD:bk.R_HEAD + 3 * nodes].tolist()  # token, parent, source rows
        return _trusted_tree(flat[:n], flat[nodes:nodes + n], req.floats[:n].tolist(),
                             flat[2 * nodes:2 * nodes + n])

    def _relayout(self, req: _Request, layout: _Layout) -> None:
        """New buffers for new corpora. A pending tree is dropped, as the build that follows
        replaces it anyway; the corpus matches start over."""
        trie_start = req.trie_start
        req.ints = np.zeros(layout.request_ints, np.int64)
        req.floats = np.zeros(layout.request_floats, np.float64)
        req.ints[bk.R_TRIE_START] = trie_start
        req.layout, req.matches = layout, _matches(layout)

    # ----------------------------------------------------------------- reading

    def stats(self) -> dict:
        """Drafted/accepted nodes per winning source, calibration tables, trie size."""
        counts = self._counts.tolist()
        per_source = {
            name: {"proposed": counts[s], "accepted": counts[NUM_SOURCES + s]}
            for s, name in SOURCE_NAMES.items()
        }
        return {
            "sources": per_source,
            "calibration": self.calibrator.stats(),
            "trie_nodes": self.trie.num_nodes,
            "trie_evicted": self.trie.num_evicted,
            "num_requests": len(self._requests),
        }


def _key(sams: dict[str, SuffixAutomaton]) -> tuple:
    """A snapshot's identity: its (name, automaton object) pairs."""
    return tuple((name, id(sam)) for name, sam in sams.items())


def _matches(layout: _Layout) -> np.ndarray:
    if layout.bank is None:
        return np.zeros((0, 3), np.int64)
    return layout.bank.new_matches()


def _trusted_tree(tokens: list[int], parents: list[int], probs: list[float],
                  sources: list[int]) -> DraftTree:
    """A DraftTree without re-validating it: the build kernel only ever emits parents < i, and
    the O(n) Python check would cost ~10% of a whole step. Tests validate these trees."""
    tree = object.__new__(DraftTree)
    tree.token_ids, tree.parents, tree.probs, tree.sources = tokens, parents, probs, sources
    return tree


@functools.cache
def warm_up() -> None:
    """Load (or compile) every kernel once per process, outside any timed step."""
    from ngramspec.drafting.kernels import context as cx
    from ngramspec.drafting.kernels import trie_bulk as tb

    class _Corpora:
        def __init__(self) -> None:
            sam = SuffixAutomaton()
            sam.add_document([1, 2, 3, 1, 2, 4])
            sam.finalize()
            self.sams = {"a": sam}

        def snapshot(self) -> dict[str, SuffixAutomaton]:
            return dict(self.sams)

    cfg = DrafterConfig(capacity=40, max_trie_depth=4, draft_token_num=4)
    corpora = _Corpora()
    drafter = NgramDrafter(cfg, warm=False)
    with_corpora = NgramDrafter(cfg, corpora, warm=False)
    for d in (drafter, with_corpora):
        d.start("warm", [1, 2, 3, 1, 2], references=[[1, 2, 4]])
        for step in range(12):  # enough to fill the capacity and evict
            if step == 6:  # two corpora: a new bank
                corpora.sams = {"a": corpora.sams["a"], "b": corpora.sams["a"]}
            (tree,) = d.propose(["warm"], [3])
            d.commit("warm", [tree.token_ids[-1], step % 5])
    trie = drafter.trie
    trie.children(0, 2)
    trie.lookup([1, 2])
    NgramTrie.from_arrays(*trie.to_arrays())
    tb.rehash(trie.cols, trie.edges.copy(), trie.runs.copy(), trie.num_nodes)
    ctx = drafter._requests["warm"].context
    ctx.anchors(2)
    cx.rehash(ctx.keys, ctx.lens, ctx.vals, ctx.keys.copy(), ctx.lens.copy(), ctx.vals.copy())
