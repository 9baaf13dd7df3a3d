"""FastNgramDrafter: NgramDrafter on the numba trie, context index and tree build.

Identical trees to the pure-Python NgramDrafter on identical inputs. Without external corpora a
propose is one `build` kernel call per request and a commit one `learn` call plus the context
and trie kernels; with corpora the (Python) NgramDrafter._build runs over the fast structures,
whose APIs match the Python ones. Per-request output arrays double as the pending tree, so
nothing is copied between propose and commit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ngramspec.drafting.calibration import ArrayCalibrator
from ngramspec.drafting.config import CorpusSnapshot, DrafterConfig
from ngramspec.drafting.oracle.drafter import NgramDrafter, _SamMatch
from ngramspec.drafting.kernels import build as bk
from ngramspec.drafting.kernels import commit as cm
from ngramspec.drafting.kernels.context import FastContextIndex
from ngramspec.drafting.index.trie import FastTrie, FastTrieState
from ngramspec.drafting.sources import NUM_SOURCES
from ngramspec.drafting.tree import DraftTree


@dataclass(slots=True)
class _FastRequest:
    tokens: list[int]  # prompt + committed output (the SAM matcher reads it)
    context: FastContextIndex  # references + separator + tokens
    trie_state: FastTrieState
    # The last kernel-built tree and its evidence (laid out as build.request_views says), with
    # trie_start and the nodes awaiting commit in the header of `ints`.
    ints: np.ndarray  # int64
    floats: np.ndarray  # float64: path probabilities first
    sam_matches: dict[str, _SamMatch] = field(default_factory=dict)
    pending_py: tuple | None = None  # (tree, evidence) of a Python-built tree

    @property
    def trie_start(self) -> int:
        """Where `tokens` begin in the context's array (after any reference documents)."""
        return int(self.ints[bk.R_TRIE_START])


class FastNgramDrafter(NgramDrafter):
    def __init__(self, config: DrafterConfig, corpora: CorpusSnapshot | None = None, *,
                 warm: bool = True) -> None:
        if warm:
            warm_up()
        self.config = config
        self.corpora = corpora
        self.trie = FastTrie(config.capacity, config.max_trie_depth)
        self.calibrator = ArrayCalibrator(config.calibrate, config.calibration_prior_weight)
        self._requests: dict[str, _FastRequest] = {}  # type: ignore[assignment]
        self._scratch = bk.Scratch(config.num_draft_tokens, config.max_bfs_breadth,
                                   config.max_anchors_per_source,
                                   config.max_context_occurrences)
        self._params: dict[int, np.ndarray] = {}  # kernel parameters by budget
        # Config values read on every step, kept as plain attributes (a request-step is ~15 µs,
        # so even property and method-call overheads show).
        self._nodes = config.num_draft_tokens + 1
        self._depth = config.max_trie_depth
        self._commit_params = self._new_params(0)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._counts = np.zeros(2 * NUM_SOURCES, np.int64)  # type: ignore[assignment]

    # ----------------------------------------------------------------- lifecycle

    def start(
        self, request_id: str, prompt_ids: list[int], references: list[list[int]] | None = None
    ) -> None:
        self._check_start(request_id, prompt_ids)
        cfg = self.config
        context = FastContextIndex(cfg.max_context_match, cfg.max_context_occurrences)
        for doc in references or ():
            context.add_document(list(doc))
        trie_start = len(context)
        context.extend(prompt_ids)
        state = self.trie.new_state()
        if cfg.insert_prompt:
            self.trie.extend(state, context.tok, trie_start, len(context))
        num_ints, num_floats = bk.request_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source)
        ints, floats = np.zeros(num_ints, np.int64), np.zeros(num_floats, np.float64)
        ints[bk.R_TRIE_START] = trie_start
        self._requests[request_id] = _FastRequest(list(prompt_ids), context, state, ints, floats)

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        req = self._requests[request_id]
        if req.pending_py is not None:
            self._learn(*req.pending_py, accepted_token_ids)
            req.pending_py = None
        req.tokens.extend(accepted_token_ids)
        new = np.asarray(accepted_token_ids, dtype=np.int32)
        ctx, trie, cal = req.context, self.trie, self.calibrator
        if req.trie_state.epoch != trie.epoch:  # prompt not inserted: anchor it as NgramTrie does
            trie.anchors(req.trie_state, ctx.tok, len(ctx))
        ctx.reserve(len(new))
        trie.reserve(len(new) * self._depth)
        # One kernel call: learn from the pending tree, index the tokens, count them.
        failed = cm.commit(req.ints, req.floats, self._commit_params, new, cal.cal, cal.prior,
                           self._counts, ctx.tok, ctx.prev, ctx.hashes, ctx.keys, ctx.lens,
                           ctx.vals, ctx.st, trie.cols, trie.edges, trie.runs, trie.meta,
                           req.trie_state.arr)
        if failed:
            raise RuntimeError("trie columns were not grown before extend (bug)")

    # ----------------------------------------------------------------- proposing

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        if len(request_ids) != len(budgets):
            raise ValueError("request_ids and budgets must have the same length")
        sams = dict(sorted(self.corpora.snapshot().items())) if self.corpora else {}
        trees = []
        cap = self._nodes - 1
        for rid, budget in zip(request_ids, budgets):
            req = self._requests[rid]
            budget = min(budget, cap)
            if sams:
                tree, evidence = self._build(req, budget, sams)  # type: ignore[arg-type]
                req.ints[bk.R_PENDING], req.pending_py = 0, (tree, evidence)
            else:
                tree = self._build_fast(req, budget)
            trees.append(tree)
        return trees

    def _new_params(self, budget: int) -> np.ndarray:
        """The kernels' parameter array for `budget` (cached in `_params`)."""
        cfg, s = self.config, self._scratch
        nodes, evidence = bk.tree_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source)
        params = np.array([budget, cfg.max_bfs_breadth, cfg.max_anchors_per_source,
                           cfg.max_context_occurrences, s.cursors, s.pool, s.groups, nodes,
                           evidence, cfg.max_context_match, int(cfg.calibrate)], np.int64)
        self._params[budget] = params
        return params

    def _build_fast(self, req: _FastRequest, budget: int) -> DraftTree:
        s, trie, ctx = self._scratch, self.trie, req.context
        if budget > 0 and req.trie_state.epoch != trie.epoch:
            trie._sync(req.trie_state)  # NgramDrafter reads trie anchors only for budget > 0
        params = self._params.get(budget)
        if params is None:
            params = self._new_params(budget)
        n = bk.build(trie.cols, trie.edges, trie.meta, req.trie_state.arr, ctx.tok, ctx.prev,
                     ctx.st, self.calibrator.cal, params, self.config.min_path_prob, s.ints,
                     s.floats, req.ints, req.floats, self._counts)
        req.pending_py = None
        nodes = self._nodes
        flat = req.ints[bk.R_HEAD:bk.R_HEAD + 3 * nodes].tolist()  # token, parent, source rows
        return _trusted_tree(flat[:n], flat[nodes:nodes + n], req.floats[:n].tolist(),
                             flat[2 * nodes:2 * nodes + n])

    def _trie_anchors(self, req: _FastRequest) -> list[tuple[int, int]]:  # type: ignore[override]
        return self.trie.anchors(req.trie_state, req.context.tok[req.trie_start:],
                                 len(req.context) - req.trie_start)

    def reset(self) -> None:
        self.trie.reset()
        self.calibrator.reset()
        self._requests.clear()
        self._reset_counters()


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

    cfg = DrafterConfig(backend="numba", capacity=40, max_trie_depth=4, draft_token_num=4)
    drafter = FastNgramDrafter(cfg, warm=False)
    drafter.start("warm", [1, 2, 3, 1, 2], references=[[1, 2, 4]])
    for step in range(12):  # enough to fill the capacity and evict
        (tree,) = drafter.propose(["warm"], [3])
        drafter.commit("warm", [tree.token_ids[-1], step % 5])
    trie = drafter.trie
    trie.children(0, 2)
    trie.lookup([1, 2])
    FastTrie.from_arrays(*trie.to_arrays())
    tb.rehash(trie.cols, trie.edges.copy(), trie.runs.copy(), trie.num_nodes)
    ctx = drafter._requests["warm"].context
    ctx.anchors(2)
    cx.rehash(ctx.keys, ctx.lens, ctx.vals, ctx.keys.copy(), ctx.lens.copy(), ctx.vals.copy())
