"""NgramDrafter: one best-first draft tree over every n-gram source, built by native kernels.

Sources (drafting/sources.py): the request's own context (references, prompt, output), the global
trie learned across requests, and every external corpus. Each source turns a matched suffix into
a cursor; a cursor lists continuation tokens with raw estimates `count / (occurrences + 1)`,
normalised within that source, which the calibrator turns into P(accepted | parent accepted) per
(source, matched length). All cursors feed ONE ranking by the estimated probability that the
whole path is accepted, so the tree is best-first: node i's path probability never exceeds that
of any earlier node (kernels/drafter.cpp `TreeBuild` has the walk, which keeps only the candidates
the tree can still take, and offers none that could not be placed).

Trie policy: the prompt and every committed token go into the global trie as soon as they are
known (count once), so concurrent requests sharing text help each other at once. The same
tokens are also in the request's own context, so both sources may propose the same token; such
candidates merge into one node that keeps the higher estimate (the two estimates are one piece
of evidence counted twice, so they are not combined as independent).

A whole propose is one kernel call (kernels/drafter.cpp `propose`): the commits queued since the last one (learn
from the pending tree, index and count the new tokens), in the order they came, then every tree of
the batch. Readers of the trie or the calibration (`trie`, `stats`) run the queue first, so every
observable state is the one eager commits would give. Per-request output arrays double as the
pending tree, so nothing is copied between propose and commit. tests/oracles/drafter.py is the pure-Python reference the
lockstep property tests hold this to, tree for tree.
"""

from __future__ import annotations

import array
import operator
from dataclasses import dataclass

import numpy as np

from ngramspec.drafting.calibration import GAIN_FLOATS, SourceCalibrator
from ngramspec.drafting.config import CorpusSnapshot, DrafterConfig
from ngramspec.drafting.index.context import ContextIndex
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.index.trie import NgramTrie, TrieState
from ngramspec.drafting.kernels import layout as bk
from ngramspec.drafting.kernels import native
from ngramspec.drafting.kernels.layout import CorpusBank, NoBank
from ngramspec.drafting.sources import NUM_SOURCES, SOURCE_NAMES
from ngramspec.drafting.tree import DraftBatch


@dataclass(slots=True)
class _Layout:
    """What the kernels' buffers look like for one set of corpora (their count sizes them)."""

    bank: CorpusBank | None  # None: no external corpus
    key: tuple  # identity of the snapshot it was made from: (name, id(automaton)) pairs
    sams: list[SuffixAutomaton]  # held so that no id in `key` is reused while it lives
    scratch: bk.Scratch
    request_ints: int
    request_floats: int
    params: np.ndarray  # the kernels' parameters (the step kernel writes each tree's budget)
    snapshot: object = None  # the last snapshot seen to hold these corpora (identity check)


@dataclass(slots=True)
class _Request:
    slot: int  # its slot in the native Drafter
    context: ContextIndex  # references + separator + prompt + committed output
    trie_state: TrieState
    # The last built tree and its evidence (laid out as layout.request_sizes says), with
    # trie_start and the nodes awaiting commit in the header of `ints`.
    ints: np.ndarray  # int64
    floats: np.ndarray  # float64: path probabilities first
    matches: np.ndarray  # int64 [corpora, 3]: the request's match in each corpus (layout.py)
    layout: _Layout  # the layout its buffers follow (re-laid at its next build when stale)

    @property
    def trie_start(self) -> int:
        """Where the request's own tokens begin in its context array (after any references)."""
        return int(self.ints[bk.R_TRIE_START])

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Its arrays in `Drafter.set_request`'s order (kernels/drafter.cpp)."""
        return (*self.context.arrays(), self.trie_state.arr, self.ints, self.floats,
                self.matches)


class NgramDrafter:
    def __init__(self, config: DrafterConfig, corpora: CorpusSnapshot | None = None) -> None:
        if config.preset != "ngramspec":
            raise ValueError(f"NgramDrafter serves the 'ngramspec' preset, not {config.preset!r}")
        self._native = native()  # built here on a machine's first use, with progress
        self.config = config
        # Fixed here: a later change to the (mutable) config must not outgrow the threads' rows.
        self._threads = config.draft_threads
        self.corpora = corpora
        self._trie = NgramTrie(config.capacity, config.max_trie_depth)
        self.calibrator = SourceCalibrator(
            config.calibrate, config.calibration_prior_weight,
            gain_prior=config.request_gain_prior, gain_decay=config.request_gain_decay)
        self._requests: dict[str, _Request] = {}
        # The kernels' view of every array: each request slot's and the shared ones.
        self._state = self._native.Drafter()
        self._free_slots: list[int] = []
        self._num_slots = 0
        # Commits and prompt insertions wait here for the next kernel call (drafter.cpp):
        # each (slot, new tokens, trie start) followed by its tokens, and how many trie
        # positions they extend; slots of stopped requests are released once their operations
        # ran.
        self._queue: list[int] = []
        self._queued_positions = 0
        self._releasing: list[int] = []
        self._queue_epoch = self._trie.epoch  # the trie's epoch when the first waiting op came
        self._shared: tuple | None = None  # what the kernels hold (_set_shared)
        # Config values read on every step, kept as plain attributes (a request-step is a few
        # µs, so even property and method-call overheads show).
        self._nodes = config.num_draft_tokens + 1
        self._depth = config.max_trie_depth
        self._min_path_prob = float(config.min_path_prob)  # the kernel's types are fixed
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
        state = self._trie.new_state()
        if cfg.insert_prompt:  # else the first commit anchors the state on the prompt
            self._trie.sync(state)
        req = _Request(self._take_slot(), context, state, np.zeros(0, np.int64),
                       np.zeros(0, np.float64), np.zeros((0, 3), np.int64), self._layout)
        self._lay_out(req, self._layout, trie_start)
        self._requests[request_id] = req
        if cfg.insert_prompt:
            if not self._queue:
                self._queue_epoch = self._trie.epoch
            self._queue += (req.slot, 0, trie_start)
            self._queued_positions += len(context) - trie_start

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        req = self._requests[request_id]
        if req.trie_state.epoch != self._trie.epoch:  # a new trie: re-anchor on its tokens
            self._flush()
            ctx = req.context
            self._trie.anchors(req.trie_state, ctx.tok[req.trie_start:],
                               len(ctx) - req.trie_start)
            self._state.set_request(req.slot, *req.arrays())
        count = len(accepted_token_ids)
        if req.context.reserve(count):
            self._state.set_request(req.slot, *req.arrays())
        queue = self._queue
        if not queue:
            self._queue_epoch = self._trie.epoch
        queue += (req.slot, count, -1)
        queue += accepted_token_ids
        self._queued_positions += count

    def stop(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if self._queue:  # its queued operations still read its arrays
            self._releasing.append(req.slot)
        else:
            self._release(req.slot)

    def reset_calibration(self) -> None:
        """Forget what was learned about acceptance (new weights); the n-gram statistics,
        which are model-free, stay, and so do the requests' own gains (they decay every step)."""
        self._flush()  # what is queued learns under the old weights' tables
        self.calibrator.reset()

    def reset(self) -> None:
        """Clear the trie, calibration and all request states; external corpora are kept."""
        self._trie.reset()
        self.calibrator.reset()
        for req in self._requests.values():
            self._release(req.slot)
        for slot in self._releasing:
            self._release(slot)
        self._requests.clear()
        self._queue, self._queued_positions, self._releasing = [], 0, []
        self._counts[:] = 0

    @property
    def trie(self) -> NgramTrie:
        """The learned trie, with every queued commit counted."""
        self._flush()
        return self._trie

    @trie.setter
    def trie(self, trie: NgramTrie) -> None:
        if trie.max_depth != self._depth:  # the kernels' scratch and reservations assume it
            raise ValueError(f"trie depth {trie.max_depth} differs from the drafter's "
                             f"max_trie_depth {self._depth}")
        self._flush()  # queued commits belong to the trie they were made under
        self._trie = trie

    # ----------------------------------------------------------------- the queue

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        return self._num_slots - 1

    def _release(self, slot: int) -> None:
        self._state.release(slot)
        self._free_slots.append(slot)

    def _set_shared(self, layout: _Layout) -> None:
        """Hand the kernels the shared arrays, again whenever the trie grew or was replaced,
        the calibration was reset or the corpora changed (each replaces an array that `_run`
        checks)."""
        trie, cal = self._trie, self.calibrator
        bank, s = layout.bank or NoBank, layout.scratch
        self._state.set_shared(layout.params, cal.cal, cal.settings, self._counts, s.ints,
                               s.floats, s.work, s.counts, trie.cols, trie.edges, trie.runs,
                               trie.meta, bank.states, bank.trans, bank.edges, bank.roots)
        self._shared = (trie.cols, cal.cal, layout.params)

    def _drop_bad_commits(self) -> None:
        """Take the commits whose tokens are not int32 token ids out of the queue (a caller's
        bug; checked when the queue is converted and by the kernel rather than in every commit,
        which would cost ~0.3 µs a step)."""
        queue, kept, bad, i = self._queue, [], [], 0
        while i < len(queue):
            slot, count = queue[i + bk.O_SLOT], queue[i + bk.O_COUNT]
            op = queue[i:i + bk.O_TOKENS + count]
            i += bk.O_TOKENS + count
            if _int32s(op[bk.O_TOKENS:]):
                kept += op
            else:
                bad.append(slot)
                self._queued_positions -= count
        if not bad:
            raise RuntimeError("the drafter kernel refused a queue of int32 tokens (bug)")
        self._queue = kept
        names = [rid for rid, req in self._requests.items() if req.slot in bad]
        raise ValueError(f"commit of requests {names}: token ids must be int32 (dropped)")

    def _failed(self, failed: int) -> None:
        """Raise for a kernel's failure code (layout.py)."""
        if failed == bk.BAD_TOKENS:  # nothing ran
            self._drop_bad_commits()  # raises, naming them; the rest of the queue stays
        if failed == bk.BAD_SLOT:  # nothing ran
            raise RuntimeError("the drafter kernel was given a request slot without its arrays "
                               "(bug)")
        raise RuntimeError("trie columns were not grown before extend (bug)")

    def flush(self) -> None:
        """Learn what start and commit queued now instead of in the next propose: the engine calls
        this while the accelerator runs a step, so the learning costs the step nothing. The
        trees are the same either way (the queue runs in the same order)."""
        self._flush()

    def _flush(self) -> None:
        """Run the queued operations now (a reader of the trie or calibration is coming)."""
        if self._queue:
            self._run([], self._layout, _NO_TREES, _NO_PROBS)  # no tree: nothing written

    # ----------------------------------------------------------------- proposing

    def propose(self, request_ids: list[str], budgets: list[int]) -> DraftBatch:
        """One tree per request (Drafter.propose). A budget is an int; any number above the
        tree's draft nodes asks for all of them (it is capped before the int check, which the
        kernel input's conversion makes: a per-request check would cost every step)."""
        num = len(request_ids)
        if num != len(budgets):
            raise ValueError("request_ids and budgets must have the same length")
        layout = self._layout
        if self.corpora is not None and self.corpora.snapshot() is not layout.snapshot:
            layout = self._current_layout()  # the registry publishes a new one on any change
        cap, trie, requests = self._nodes - 1, self._trie, self._requests
        batch: list[int] = []  # (slot, budget) per request (drafter.cpp `propose`)
        for rid, budget in zip(request_ids, budgets):  # one pass: this runs per request-step
            req = requests[rid]
            if budget > cap:  # noqa: PLR1730 (not min(): a builtin call shows at this scale)
                budget = cap
            if req.layout is not layout or budget > 0 and req.trie_state.epoch != trie.epoch:
                self._refresh(req, layout, budget)
            batch += (req.slot, budget)
        # Per request: tokens, parents and sources (nodes columns each), then the node count;
        # and the path probabilities (drafter.cpp `build_one`).
        out = np.empty((num, 3 * self._nodes + 1), np.int64)
        out_p = np.empty((num, self._nodes), np.float64)
        self._run(batch, layout, out, out_p)
        return DraftBatch.trusted(out, out_p)  # shaped above

    def _refresh(self, req: _Request, layout: _Layout, budget: int) -> None:
        """A request's buffers laid out for new corpora (its queued commits first learn from the
        tree built under the old ones), and, when it drafts, its trie state synced after a trie
        reset (without a tree, its next commit re-anchors it instead)."""
        if req.layout is not layout:
            self._flush()
            self._lay_out(req, layout, req.trie_start)
        if budget > 0 and req.trie_state.epoch != self._trie.epoch:
            self._trie.sync(req.trie_state)
            self._state.set_request(req.slot, *req.arrays())

    def _run(self, batch: list[int], layout: _Layout, out: np.ndarray,
             out_p: np.ndarray) -> None:
        """One kernel call (drafter.cpp `propose`): the queue, then the batch's trees into `out` and
        `out_p`. Its input is one int64 array.array, made in one conversion (~0.25 µs; numpy's
        ~0.45 µs), which refuses what is not an int (np.fromiter truncated 1.5 to 1)."""
        trie, queue = self._trie, self._queue
        if queue and trie.epoch != self._queue_epoch:
            self._resync()
        try:
            io = array.array("q", queue + batch)
        except (OverflowError, TypeError):
            if not _int64s(batch):  # the slots are ours: a budget
                raise ValueError("budgets must be int64 integers") from None
            self._drop_bad_commits()  # raises, naming them; the rest of the queue stays
        # Counted again if the queue does not run now (bad tokens): that only grows it sooner.
        trie.reserve(self._queued_positions * self._depth)
        shared = self._shared
        if (shared is None or shared[0] is not trie.cols or shared[1] is not self.calibrator.cal
                or shared[2] is not layout.params):
            self._set_shared(layout)
        num = len(batch) // 2
        # Threads only pay off with a few requests each (starting one is not free); a slot
        # named twice (a caller's bug) would be built by two threads at once.
        parallel = (self._threads > 1 and num >= 4 * self._threads
                    and len(set(batch[::2])) == num)
        failed = self._state.propose(io, len(queue), out, out_p, self._min_path_prob, parallel)
        if failed:
            self._failed(failed)
        self._queue, self._queued_positions = [], 0
        if self._releasing:  # rare (a request stopped with operations queued)
            for slot in self._releasing:
                self._release(slot)
            self._releasing = []

    def _resync(self) -> None:
        """The trie was reset by someone holding it while operations waited (the drafter's own
        readers run the queue first): they go to the new trie, and no anchor may name a node it
        no longer has."""
        trie = self._trie
        for req in self._requests.values():
            if req.trie_state.epoch != trie.epoch:
                trie.sync(req.trie_state)
                self._state.set_request(req.slot, *req.arrays())

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
                             cfg.max_anchors_per_source, cfg.max_context_occurrences, num_corpora,
                             cfg.max_trie_depth, 2 * NUM_SOURCES, self._threads)
        ints, floats = bk.request_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source,
                                        num_corpora)
        bank = CorpusBank(list(sams.values())) if sams else None
        nodes, evidence = bk.tree_sizes(cfg.num_draft_tokens, cfg.max_anchors_per_source,
                                        num_corpora)
        params = np.array([cfg.max_bfs_breadth, cfg.max_anchors_per_source,
                           cfg.max_context_occurrences, scratch.cursors, scratch.pool,
                           scratch.groups, nodes, evidence, cfg.max_context_match,
                           int(cfg.calibrate), cfg.max_sam_match, cfg.max_wildcards,
                           int(cfg.trie_fallback)], np.int64)
        return _Layout(bank, _key(sams), list(sams.values()), scratch, ints, floats, params)

    def _lay_out(self, req: _Request, layout: _Layout, trie_start: int) -> None:
        """Buffers for `layout`'s corpora. On a relayout a pending tree is dropped (the build that
        follows replaces it; its queued commits already ran), the corpus matches start over and
        the request's gain sums (the floats' last GAIN_FLOATS) are kept."""
        evidence = layout.params[bk.P_EVIDENCE]
        req.ints = np.zeros(layout.request_ints, np.int64)
        floats = np.zeros(layout.request_floats, np.float64)
        if req.floats.size:  # empty before the first lay-out
            floats[-GAIN_FLOATS:] = req.floats[-GAIN_FLOATS:]
        req.floats = floats
        req.ints[bk.R_TRIE_START], req.ints[bk.R_EVIDENCE] = trie_start, evidence
        req.matches, req.layout = _matches(layout), layout
        self._state.set_request(req.slot, *req.arrays())

    # ----------------------------------------------------------------- reading

    def request_gains(self, request_id: str) -> dict[str, float]:
        """The request's acceptance gain per source (calibration.py), as its next tree uses."""
        self._flush()
        sums = self._requests[request_id].floats[-GAIN_FLOATS:].tolist()
        return {name: self.calibrator.request_gain(sums, s) for s, name in SOURCE_NAMES.items()}

    def stats(self) -> dict:
        """Drafted/accepted nodes per winning source, calibration tables, trie size."""
        self._flush()
        counts = self._counts.tolist()
        per_source = {
            name: {"proposed": counts[s], "accepted": counts[NUM_SOURCES + s]}
            for s, name in SOURCE_NAMES.items()
        }
        return {
            "sources": per_source,
            "calibration": self.calibrator.stats(),
            "trie_nodes": self._trie.num_nodes,
            "trie_evicted": self._trie.num_evicted,
            "num_requests": len(self._requests),
        }


_NO_TREES = np.empty((0, 1), np.int64)  # the output of a call that builds no tree
_NO_PROBS = np.empty((0, 1), np.float64)


def _key(sams: dict[str, SuffixAutomaton]) -> tuple:
    """A snapshot's identity: its (name, automaton object) pairs."""
    return tuple((name, id(sam)) for name, sam in sams.items())


def _matches(layout: _Layout) -> np.ndarray:
    if layout.bank is None:
        return np.zeros((0, 3), np.int64)
    return layout.bank.new_matches()


def _int64s(values: list) -> bool:
    """Every value is an integer that fits an int64 (what the kernel's input array holds)."""
    try:
        array.array("q", values)
    except (OverflowError, TypeError):
        return False
    return True


def _int32s(tokens: list) -> bool:
    """Every token is an integer that fits an int32."""
    try:
        return all(-(2**31) <= operator.index(t) < 2**31 for t in tokens)
    except TypeError:
        return False
