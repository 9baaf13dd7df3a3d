"""One numba call per engine step: every queued commit, then every requested tree.

A request-step's real work is a few µs, less than the fixed cost of one numba call per request
and per commit (argument unboxing, views, Python glue). So the drafter queues its commits and runs them at the next propose, in the order they came,
followed by every tree of the batch, in one call (kernels/__init__.py: what is inlined into it).

The kernel finds each request's arrays through `RequestTable`: per slot, the address and length
of each array (field columns `F_*`). The table holds a reference to every array whose address it
stores, so an address never outlives its array; `set` is the only way in or out. (A numba typed
list of arrays per field would cost far more to unbox and read each step than an address.)

The arrays every step reads besides the requests' own (trie, calibration, scratch, corpus bank,
the RequestTable's own two) reach the kernel the same way, as one `Globals` table of addresses and
shapes: numba's dispatch costs ~0.1 µs an array argument, a large share of a request-step.

The queue and the batch travel as ONE array.array of int64 (one conversion of the drafter's list,
cheaper than a numpy array; numba reads it through the buffer protocol): first the queued operations, each (slot, new tokens, trie start)
followed by its new tokens: append them to the request's context, learning first from its pending
tree, then count the n-grams ending at the positions from trie start (-1: the first new token) in
the trie; a request's start queues (slot, 0, where its prompt begins). Then the batch: (slot,
budget) per request; the drafter's flush sends none. A queued token outside int32 fails the whole
call before anything runs (BAD_TOKENS), so the caller can drop the bad commits and run the rest.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ngramspec.drafting.kernels import build as bk
from ngramspec.drafting.kernels import commit as cm
from ngramspec.drafting.kernels import context as cx
from ngramspec.drafting.kernels import hashtab as ht
from ngramspec.drafting.kernels import sam as sk

F_TOK, F_PREV, F_HASHES, F_TABLE, F_ST, F_TSTATE, F_INTS, F_FLOATS, F_MATCHES = range(9)
NUM_FIELDS = 9
# The dtype of each field, and its second dimension (0: a 1-d array).
FIELD_DTYPES = (np.int32, np.int32, np.uint64, np.uint64, np.int64, np.int32, np.int64,
                np.float64, np.int64)
FIELD_COLUMNS = (0, 0, 0, 2, 0, 0, 0, 0, 3)
O_SLOT, O_COUNT, O_TRIE_FROM, O_TOKENS = range(4)  # a queued operation's header, then its tokens
BAD_TOKENS = -3  # a queued token is not an int32 (nothing ran); -2: the trie was not grown first
# Rows of the Globals table, and the dtype and number of dimensions each must have.
(G_ADDR, G_SIZE, G_PARAMS, G_CAL, G_SETTINGS, G_STATS, G_S_INTS, G_S_FLOATS, G_WORK,
 G_THREAD_STATS, G_COLS, G_EDGES, G_RUNS, G_META, G_STATES, G_TRANS, G_CORPUS_EDGES,
 G_ROOTS, G_LANES) = range(19)
GLOBAL_SPECS = ((np.int64, 2), (np.int64, 2), (np.int64, 1), (np.float64, 3), (np.float64, 1),
                (np.int64, 1), (np.int64, 2), (np.float64, 2), (np.int64, 2), (np.int64, 2),
                (np.int32, 2), (np.int32, 1), (np.int32, 1), (np.int64, 1), (np.int32, 2),
                (np.int32, 2), (np.int32, 2), (np.int64, 1), (np.int64, 2))


class RequestTable:
    """Addresses and lengths of each slot's arrays (see the module docstring)."""

    def __init__(self, slots: int = 64) -> None:
        self.addr = np.zeros((slots, NUM_FIELDS), np.int64)
        self.size = np.zeros((slots, NUM_FIELDS), np.int64)
        self._held: list[tuple | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        """A free slot (the table grows when none is left)."""
        if not self._free:
            old = len(self._held)
            self.addr = _grown_rows(self.addr, 2 * old)
            self.size = _grown_rows(self.size, 2 * old)
            self._held += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def set(self, slot: int, arrays: tuple) -> None:
        """Point `slot` at `arrays` (one per field, in field order) and hold them."""
        for f, (a, dtype, columns) in enumerate(zip(arrays, FIELD_DTYPES, FIELD_COLUMNS)):
            if a.dtype != dtype or not a.flags.c_contiguous or a.ndim != (2 if columns else 1) \
                    or (columns and a.shape[1] != columns):
                raise TypeError(f"field {f}: expected a C-contiguous {np.dtype(dtype)} array "
                                f"with {columns or 'no'} columns, got {a.dtype} {a.shape}")
            self.addr[slot, f] = a.ctypes.data
            self.size[slot, f] = a.shape[0]
        self._held[slot] = arrays

    def release(self, slot: int) -> None:
        self.addr[slot] = 0
        self.size[slot] = 0
        self._held[slot] = None
        self._free.append(slot)


class Globals:
    """Addresses and shapes of the arrays in `GLOBAL_SPECS` order (rows: address, then up to
    three dimensions), holding each array so that no address outlives it (module docstring).
    The drafter makes a new one whenever any of them is replaced."""

    def __init__(self, arrays: tuple[np.ndarray, ...]) -> None:
        if len(arrays) != len(GLOBAL_SPECS):
            raise ValueError(f"expected {len(GLOBAL_SPECS)} arrays, got {len(arrays)}")
        self.table = np.zeros((len(arrays), 4), np.int64)
        for g, (a, (dtype, ndim)) in enumerate(zip(arrays, GLOBAL_SPECS)):
            if a.dtype != dtype or not a.flags.c_contiguous or a.ndim != ndim:
                raise ValueError(f"global {g}: expected a C-contiguous {ndim}-d "
                                 f"{np.dtype(dtype)} array, got {a.dtype} {a.shape}")
            self.table[g, 0] = a.ctypes.data
            self.table[g, 1:1 + ndim] = a.shape
        self.arrays = arrays
        # The arrays that get replaced (the drafter checks these for a new table each step)
        self.addr, self.params, self.cal = arrays[G_ADDR], arrays[G_PARAMS], arrays[G_CAL]
        self.cols = arrays[G_COLS]


def _grown_rows(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, a.shape[1]), a.dtype)
    out[: len(a)] = a
    return out


@intrinsic
def _pointer(typingctx, address):
    """An int64 address as a void pointer (for numba.carray)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@intrinsic
def _buffer_address(typingctx, buf):
    """The address of a buffer's first item (numba types an array.array without `ctypes`): of a
    C-contiguous 1-d int64 buffer only, the queue's type (anything else fails to compile, so no
    int32 or strided buffer is read as the queue; numba checks no buffer's format at the call)."""
    if not (isinstance(buf, types.Buffer) and buf.dtype == types.int64 and buf.ndim == 1
            and buf.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, cgutils.intp_t)

    return types.intp(buf), codegen


@njit(cache=True, inline="always")
def _queue_ints(io):
    """The queue and batch, an array.array of int64 (module docstring; or a numpy view of one),
    as a bare array like `_raw`'s; the caller's frame holds `io`, and numba holds its buffer
    for the call."""
    return numba.carray(_pointer(_buffer_address(io)), len(io), np.int64)


@njit(cache=True, inline="always")
def _view(addr, size, slot, f, dtype):
    return numba.carray(_pointer(addr[slot, f]), size[slot, f], dtype)


@njit(cache=True, inline="always")
def _view2(addr, size, slot, f, columns, dtype):
    return numba.carray(_pointer(addr[slot, f]), (size[slot, f], columns), dtype)


@njit(cache=True, inline="always")
def _g1(g, row, dtype):
    return numba.carray(_pointer(g[row, 0]), g[row, 1], dtype)


@njit(cache=True, inline="always")
def _g2(g, row, dtype):
    return numba.carray(_pointer(g[row, 0]), (g[row, 1], g[row, 2]), dtype)


@njit(cache=True, inline="always")
def _g3(g, row, dtype):
    return numba.carray(_pointer(g[row, 0]), (g[row, 1], g[row, 2], g[row, 3]), dtype)


@njit(cache=True, inline="always")
def _raw(a):
    """`a` without its reference count: numba's atomic incref/decref on every array handed to a
    callee or sliced cost more than the work; an array from a bare address has no meminfo, so
    those become a null test. The caller's Python frame holds `a` for the whole call; never pass an array made
    inside a kernel: numba frees it after its last use, which is this call."""
    if not a.flags.c_contiguous:
        raise ValueError("drafter kernels take C-contiguous arrays only")
    return numba.carray(_pointer(a.ctypes.data), a.shape, a.dtype)


@njit(cache=True, inline="always")
def _apply_one(addr, size, slot, new, trie_from, params, cal, settings, stats, cols, edges, runs,
               meta, work) -> int:
    return cm.commit_one(
        _view(addr, size, slot, F_INTS, np.int64), _view(addr, size, slot, F_FLOATS, np.float64),
        params, new, trie_from, cal, settings, stats, _view(addr, size, slot, F_TOK, np.int32),
        _view(addr, size, slot, F_PREV, np.int32), _view(addr, size, slot, F_HASHES, np.uint64),
        _view2(addr, size, slot, F_TABLE, 2, np.uint64), _view(addr, size, slot, F_ST, np.int64),
        cols, edges, runs, meta, _view(addr, size, slot, F_TSTATE, np.int32), work)


@njit(cache=True, inline="always")
def _queue_is_int32(io, queued) -> bool:
    """Every queued token fits an int32 (the context and trie store int32 tokens)."""
    i = 0
    while i < queued:
        count = io[i + O_COUNT]
        for j in range(i + O_TOKENS, i + O_TOKENS + count):
            if io[j] < -(2**31) or io[j] >= 2**31:
                return False
        i += O_TOKENS + count
    return True


@njit(cache=True, inline="always")
def _apply_queue(io, queued, g) -> int:
    """Run the queued operations (io[:queued]) in order; 0, BAD_TOKENS (nothing ran), or -2
    when the trie was not grown first (a bug)."""
    if not _queue_is_int32(io, queued):
        return BAD_TOKENS
    addr, size = _g2(g, G_ADDR, np.int64), _g2(g, G_SIZE, np.int64)
    params, cal = _g1(g, G_PARAMS, np.int64), _g3(g, G_CAL, np.float64)
    settings, stats = _g1(g, G_SETTINGS, np.float64), _g1(g, G_STATS, np.int64)
    cols, edges = _g2(g, G_COLS, np.int32), _g1(g, G_EDGES, np.int32)
    runs, meta = _g1(g, G_RUNS, np.int32), _g1(g, G_META, np.int64)
    work = _g2(g, G_WORK, np.int64)[0]
    i = 0
    while i < queued:
        count = io[i + O_COUNT]
        start = i + O_TOKENS
        failed = _apply_one(addr, size, io[i + O_SLOT], io[start:start + count],
                            io[i + O_TRIE_FROM], params, cal, settings, stats, cols, edges, runs,
                            meta, work)
        if failed:
            return failed
        i = start + count
    return 0


@njit(cache=True, inline="always")
def _build_one(i, t, batch, out, out_p, addr, size, params, min_path_prob, cal, settings, stats,
               s_ints, s_floats, cols, edges, meta, states, trans, corpus_edges, roots,
               work) -> None:
    """Request i of the batch with thread t's scratch: its tree into row i of `out` (tokens,
    parents and sources, nodes columns each, then the node count) and of `out_p` (path
    probabilities); only a tree's own nodes are written."""
    nodes = params[bk.P_NODES]
    slot = batch[2 * i]
    r_ints = _view(addr, size, slot, F_INTS, np.int64)
    r_floats = _view(addr, size, slot, F_FLOATS, np.float64)
    bank = (states, trans, corpus_edges, roots, _view2(addr, size, slot, F_MATCHES, 3, np.int64))
    n = bk.build(cols, edges, meta, _view(addr, size, slot, F_TSTATE, np.int32),
                 _view(addr, size, slot, F_TOK, np.int32),
                 _view(addr, size, slot, F_PREV, np.int32),
                 _view(addr, size, slot, F_ST, np.int64), cal, settings, params,
                 batch[2 * i + 1],
                 min_path_prob, s_ints[t], s_floats[t], r_ints, r_floats, stats, bank, work[t])
    for f in range(3):
        for j in range(n):
            out[i, f * nodes + j] = r_ints[bk.R_HEAD + f * nodes + j]
    for j in range(n):
        out_p[i, j] = r_floats[j]
    out[i, 3 * nodes] = n


@njit(cache=True)
def build_block(lo, hi, t, batch, out, out_p, g, min_path_prob) -> None:
    """Requests lo..hi of the batch on thread t's scratch. Not inlined: the build inlines its
    whole call tree (a numba call passes every array as ~10 words, and the build's helpers take
    ~20 arrays), and compiling that once here, rather than into both the serial and the
    threaded kernel, keeps the first compile short. Thread t counts its drafts in its own row
    of the thread stats (a shared += would race)."""
    # Bare again here, so that this function knows no array has a reference count to keep.
    batch, out, out_p, g = _raw(batch), _raw(out), _raw(out_p), _raw(g)
    addr, size = _g2(g, G_ADDR, np.int64), _g2(g, G_SIZE, np.int64)
    params, cal = _g1(g, G_PARAMS, np.int64), _g3(g, G_CAL, np.float64)
    settings = _g1(g, G_SETTINGS, np.float64)
    stats = _g2(g, G_THREAD_STATS, np.int64)[t]
    s_ints, s_floats = _g2(g, G_S_INTS, np.int64), _g2(g, G_S_FLOATS, np.float64)
    cols, edges, meta = _g2(g, G_COLS, np.int32), _g1(g, G_EDGES, np.int32), \
        _g1(g, G_META, np.int64)
    states, trans = _g2(g, G_STATES, np.int32), _g2(g, G_TRANS, np.int32)
    corpus_edges, roots = _g2(g, G_CORPUS_EDGES, np.int32), _g1(g, G_ROOTS, np.int64)
    work = _g2(g, G_WORK, np.int64)
    for i in range(lo, hi):
        _build_one(i, t, batch, out, out_p, addr, size, params, min_path_prob, cal, settings,
                   stats, s_ints, s_floats, cols, edges, meta, states, trans, corpus_edges,
                   roots, work)


@njit(cache=True, inline="always")
def _start_walks(slot, lanes, live, states, trans, roots, addr, size, cap) -> int:
    """Lanes (kernels/sam.py) feeding the request's matches in every corpus the tokens it has
    now, appended to the `live` ones (which step first while there is no room for them); the
    number live."""
    while live > lanes.shape[0] - roots.shape[0]:  # Scratch.lanes holds >= one per corpus
        live = _step_walks(lanes, live, states, trans, roots, addr, size, cap)
    lo = _view(addr, size, slot, F_INTS, np.int64)[bk.R_TRIE_START]
    n = _view(addr, size, slot, F_ST, np.int64)[cx.NUM]
    match = _view2(addr, size, slot, F_MATCHES, 3, np.int64)
    for k in range(roots.shape[0]):
        if sk.start_lane(roots, k, match[k], lo, n, cap, lanes[live]):
            lanes[live, sk.L_SLOT] = slot
            live += 1
    return live


@njit(cache=True, inline="always")
def _drop_lane(lanes, live, j) -> int:
    live -= 1
    for c in range(sk.LANE_COLUMNS):  # a loop: no parfor in propose_parallel
        lanes[j, c] = lanes[live, c]
    return live


@njit(cache=True, inline="always")
def _step_walks(lanes, live, states, trans, roots, addr, size, cap) -> int:
    """One read of every live lane; a lane that fed its last token writes its match and is
    dropped. The number still live."""
    j = 0
    while j < live:
        lane = lanes[j]
        slot, k = lane[sk.L_SLOT], lane[sk.L_CORPUS]
        if sk.step_lane(states, trans, roots[k], lane,
                        _view(addr, size, slot, F_TOK, np.int32), cap):
            sk.finish_lane(lane, _view2(addr, size, slot, F_MATCHES, 3, np.int64)[k])
            live = _drop_lane(lanes, live, j)
        else:
            j += 1
    return live


@njit(cache=True, inline="always")
def _catch_up_batch(batch, g) -> None:
    """Every corpus match of the batch's drafting requests fed its new tokens before the builds
    read them (a request without a tree is fed at its next), the walks interleaved so that their
    cache misses overlap (kernels/sam.py `step_lane`), at most Scratch.lanes at once (preallocated:
    an array made here and passed through `_raw` is freed at once, `_raw` says why). Then the
    first edges the builds' root corpus cursors read are prefetched (`_prefetch_root_edges`)."""
    roots = _g1(g, G_ROOTS, np.int64)
    num, corpora = batch.shape[0] // 2, roots.shape[0]
    if corpora == 0:
        return
    addr, size = _g2(g, G_ADDR, np.int64), _g2(g, G_SIZE, np.int64)
    states, trans = _g2(g, G_STATES, np.int32), _g2(g, G_TRANS, np.int32)
    cap = _g1(g, G_PARAMS, np.int64)[bk.P_SAM_MATCH]
    lanes = _g2(g, G_LANES, np.int64)
    live = 0
    for i in range(num):
        if batch[2 * i + 1] > 0:  # else no tree: its build reads no match
            live = _start_walks(batch[2 * i], lanes, live, states, trans, roots, addr, size, cap)
    while live > 0:
        live = _step_walks(lanes, live, states, trans, roots, addr, size, cap)
    corpus_edges = _g2(g, G_CORPUS_EDGES, np.int32)
    anchors = _g1(g, G_PARAMS, np.int64)[bk.P_ANCHORS]
    for i in range(num):
        if batch[2 * i + 1] > 0:
            _prefetch_root_edges(_view2(addr, size, batch[2 * i], F_MATCHES, 3, np.int64),
                                 states, corpus_edges, roots, anchors)


@njit(cache=True, inline="always")
def _prefetch_root_edges(match, states, corpus_edges, roots, anchors) -> None:
    """The first edges of the states a build's root corpus cursors will start from (the same
    `sam.anchor_state` climb as build.py `_root_cursors`): their reads overlap the context and
    trie work that comes first. A hint: it changes no result."""
    for k in range(roots.shape[0]):
        state = match[k, sk.M_STATE]
        for _ in range(anchors):
            state = sk.anchor_state(states, roots[k], state)
            if state == roots[k]:
                break
            lo = states[state, sk.S_EDGE]
            ht.prefetch(corpus_edges, lo)
            ht.prefetch(corpus_edges, lo + 4)  # a cursor reads up to `breadth` edges
            state = states[state, sk.S_LINK]


@njit(cache=True, inline="always")
def _propose(io, queued, out, out_p, g, min_path_prob) -> int:
    """The queue (io[:queued]), then one tree per request of the batch (io[queued:]: (slot,
    budget) per request). The queue runs alone (it writes the shared trie and calibration); a
    build only reads those and writes its own request's buffers and its thread's scratch, work
    and count rows, so thread t takes the t-th of T contiguous blocks of the batch (T = the
    scratch's rows) and the trees are the same whatever runs the blocks: `propose` one after
    another, `propose_parallel` on threads. The batch must not name a slot twice (two threads
    would build it). The request's own buffers keep the tree and its evidence for the commit
    that follows."""
    io, g = _queue_ints(io), _raw(g)
    failed = _apply_queue(io, queued, g)
    if failed:
        return failed
    stats, thread_stats = _g1(g, G_STATS, np.int64), _g2(g, G_THREAD_STATS, np.int64)
    threads = min(g[G_S_INTS, 1], g[G_WORK, 1], thread_stats.shape[0])
    batch = io[queued:]
    num = batch.shape[0] // 2
    _catch_up_batch(batch, g)
    for t in prange(threads):
        build_block(t * num // threads, (t + 1) * num // threads, t, batch, out, out_p, g,
                    min_path_prob)
    for t in range(threads):  # each thread counted its own drafts
        for j in range(stats.shape[0]):
            stats[j] += thread_stats[t, j]
            thread_stats[t, j] = 0
    return 0


@njit(cache=True)
def propose(io, queued, out, out_p, g, min_path_prob) -> int:
    """`_propose` on the calling thread (a parallel region costs ~1.5 µs: small batches)."""
    return _propose(io, queued, out, out_p, g, min_path_prob)


@njit(cache=True, parallel=True)
def propose_parallel(io, queued, out, out_p, g, min_path_prob) -> int:
    """`_propose` with the blocks of the batch on numba's threads."""
    return _propose(io, queued, out, out_p, g, min_path_prob)


def direct(kernel, *args):
    """`kernel`'s compiled code for the types of `args` (compiled or loaded from the cache now),
    as a callable that skips numba's dispatch: the dispatcher types every argument on every
    call, ~0.25 µs, a few percent of a request-step. The callable checks only each array's
    item size, not its dtype, dimensions or layout: call it only with arrays made for it the
    same way as `args` (a C-contiguous array of another dtype of the same size would be read as
    the compiled one)."""
    return kernel.compile(tuple(numba.typeof(a) for a in args))
