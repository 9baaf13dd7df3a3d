"""One numba call per engine step: every queued commit, then every requested tree.

A request-step's real work is a few µs, and one numba call per request and per commit cost ~5 µs
more (argument unboxing, views, Python glue: measured by calling the kernels with nothing to do).
So the drafter queues its commits and runs them at the next propose, in the order they came,
followed by every tree of the batch, in one call (kernels/__init__.py: what is inlined into it).

The kernel finds each request's arrays through `RequestTable`: per slot, the address and length
of each array (field columns `F_*`). The table holds a reference to every array whose address it
stores, so an address never outlives its array; `set` is the only way in or out. (A numba typed
list of arrays was the alternative: unboxing one costs ~1.3 µs and reading an item ~45 ns, one
list per field per step and one item per field and request; reading an address here costs ~1 ns.)

Queued operations are triples (slot, new tokens, trie start): append that many tokens (taken in
order from one token array) to the request's context, learning first from its pending tree, then
count the n-grams ending at the positions from trie start (-1: the first new token) in the trie.
A request's start queues (slot, 0, where its prompt begins).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ngramspec.drafting.kernels import build as bk
from ngramspec.drafting.kernels import commit as cm

F_TOK, F_PREV, F_HASHES, F_TABLE, F_ST, F_TSTATE, F_INTS, F_FLOATS, F_MATCHES = range(9)
NUM_FIELDS = 9
# The dtype of each field, and its second dimension (0: a 1-d array).
FIELD_DTYPES = (np.int32, np.int32, np.uint64, np.uint64, np.int64, np.int32, np.int64,
                np.float64, np.int64)
FIELD_COLUMNS = (0, 0, 0, 2, 0, 0, 0, 0, 3)
O_SLOT, O_COUNT, O_TRIE_FROM = range(3)  # fields of a queued operation (flat triples)


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


@njit(cache=True, inline="always")
def _view(addr, size, slot, f, dtype):
    return numba.carray(_pointer(addr[slot, f]), size[slot, f], dtype)


@njit(cache=True, inline="always")
def _view2(addr, size, slot, f, columns, dtype):
    return numba.carray(_pointer(addr[slot, f]), (size[slot, f], columns), dtype)


@njit(cache=True, inline="always")
def _raw(a):
    """`a` without its reference count: numba's atomic incref/decref on every array handed to a
    callee or sliced cost more than the work (perf: ~16% of a replay's samples, more than a
    third of the kernels' own); an array from a bare address has no meminfo, so those become a
    null test. The caller's Python frame holds `a` for the whole call."""
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


@njit(cache=True)
def apply_queue(ops, tokens, addr, size, params, cal, settings, stats, cols, edges, runs, meta,
                work) -> int:
    """Run the queued operations (flat triples) in order; 0, or -2 when the trie was not grown
    first (a bug)."""
    ops, tokens, addr, size, params = _raw(ops), _raw(tokens), _raw(addr), _raw(size), _raw(params)
    cal, settings, stats, cols = _raw(cal), _raw(settings), _raw(stats), _raw(cols)
    edges, runs, meta, work = _raw(edges), _raw(runs), _raw(meta), _raw(work)
    at = 0
    for i in range(0, ops.shape[0], 3):
        count = ops[i + O_COUNT]
        failed = _apply_one(addr, size, ops[i + O_SLOT], tokens[at:at + count],
                            ops[i + O_TRIE_FROM], params, cal, settings, stats, cols, edges, runs,
                            meta, work)
        if failed:
            return failed
        at += count
    return 0


@njit(cache=True, inline="always")
def _build_one(i, t, batch, out, out_p, addr, size, params, min_path_prob, cal, settings, stats,
               s_ints, s_floats, cols, edges, meta, states, trans, corpus_edges, roots,
               work) -> None:
    """Request i of the batch with thread t's scratch: its tree into row i of `out` (tokens,
    parents and sources, nodes columns each) and of `out_p` (path probabilities, then the node
    count in the last column: one array less to convert)."""
    nodes = params[bk.P_NODES]
    num = batch.shape[0] // 2
    slot = batch[i]
    r_ints = _view(addr, size, slot, F_INTS, np.int64)
    r_floats = _view(addr, size, slot, F_FLOATS, np.float64)
    bank = (states, trans, corpus_edges, roots, _view2(addr, size, slot, F_MATCHES, 3, np.int64))
    n = bk.build(cols, edges, meta, _view(addr, size, slot, F_TSTATE, np.int32),
                 _view(addr, size, slot, F_TOK, np.int32),
                 _view(addr, size, slot, F_PREV, np.int32),
                 _view(addr, size, slot, F_ST, np.int64), cal, settings, params,
                 batch[num + i],
                 min_path_prob, s_ints[t], s_floats[t], r_ints, r_floats, stats, bank, work[t])
    for j in range(3 * nodes):
        out[i, j] = r_ints[bk.R_HEAD + j]
    for j in range(n):
        out_p[i, j] = r_floats[j]
    out_p[i, nodes] = n


@njit(cache=True)
def build_block(lo, hi, t, batch, out, out_p, addr, size, params, min_path_prob, cal, settings,
                stats, s_ints, s_floats, cols, edges, meta, states, trans, corpus_edges, roots,
                work) -> None:
    """Requests lo..hi of the batch on thread t's scratch. Not inlined: the build inlines its
    whole call tree (a numba call passes every array as ~10 words, and the build's helpers take
    ~20 arrays), and compiling that once here, rather than into both the serial and the
    threaded kernel, keeps the first compile short."""
    # Bare again here, so that this function knows no array has a reference count to keep.
    batch, out, out_p, s_ints, s_floats = _raw(batch), _raw(out), _raw(out_p), _raw(s_ints), \
        _raw(s_floats)
    states, trans, corpus_edges, roots = _raw(states), _raw(trans), _raw(corpus_edges), _raw(roots)
    addr, size, params, cal, stats = _raw(addr), _raw(size), _raw(params), _raw(cal), _raw(stats)
    cols, edges, meta, work, settings = _raw(cols), _raw(edges), _raw(meta), _raw(work), \
        _raw(settings)
    for i in range(lo, hi):
        _build_one(i, t, batch, out, out_p, addr, size, params, min_path_prob, cal, settings,
                   stats, s_ints, s_floats, cols, edges, meta, states, trans, corpus_edges,
                   roots, work)


@njit(cache=True, inline="always")
def _propose(ops, tokens, batch, out, out_p, addr, size, params, min_path_prob, cal, settings,
             stats, s_ints, s_floats, cols, edges, runs, meta, states, trans, corpus_edges, roots,
             work, thread_stats) -> int:
    """The queue, then one tree per request of `batch` (its slots, then their budgets). The
    queue runs alone (it writes the shared trie and calibration); a build only reads those and
    writes its own request's buffers and its thread's scratch, work and count rows, so thread t
    takes the t-th of T contiguous blocks of the batch (T = the scratch's rows) and the trees are
    the same whatever runs the blocks: `propose` one after another, `propose_parallel` on
    threads. The batch must not name a slot twice (two threads would build it). The request's
    own buffers keep the tree and its evidence for the commit that follows. The two roots it
    calls make their arrays bare themselves (`_raw`): here each array is passed once a step."""
    failed = apply_queue(ops, tokens, addr, size, params, cal, settings, stats, cols, edges, runs,
                         meta, work[0])
    if failed:
        return failed
    threads = min(s_ints.shape[0], work.shape[0], thread_stats.shape[0])
    num = batch.shape[0] // 2
    for t in prange(threads):
        build_block(t * num // threads, (t + 1) * num // threads, t, batch, out, out_p, addr,
                    size, params, min_path_prob, cal, settings, thread_stats[t], s_ints,
                    s_floats, cols, edges, meta, states, trans, corpus_edges, roots, work)
    for t in range(threads):  # each thread counted its own drafts (a shared += would race)
        for j in range(stats.shape[0]):
            stats[j] += thread_stats[t, j]
            thread_stats[t, j] = 0
    return 0


@njit(cache=True)
def propose(ops, tokens, batch, out, out_p, addr, size, params, min_path_prob, cal, settings, stats,
            s_ints, s_floats, cols, edges, runs, meta, states, trans, corpus_edges, roots, work,
            thread_stats) -> int:
    """`_propose` on the calling thread (a parallel region costs ~1.5 µs: small batches)."""
    return _propose(ops, tokens, batch, out, out_p, addr, size, params, min_path_prob, cal,
                    settings, stats, s_ints, s_floats, cols, edges, runs, meta, states, trans,
                    corpus_edges, roots, work, thread_stats)


@njit(cache=True, parallel=True)
def propose_parallel(ops, tokens, batch, out, out_p, addr, size, params, min_path_prob, cal,
                     settings, stats, s_ints, s_floats, cols, edges, runs, meta, states, trans,
                     corpus_edges, roots, work, thread_stats) -> int:
    """`_propose` with the blocks of the batch on numba's threads."""
    return _propose(ops, tokens, batch, out, out_p, addr, size, params, min_path_prob, cal,
                    settings, stats, s_ints, s_floats, cols, edges, runs, meta, states, trans,
                    corpus_edges, roots, work, thread_stats)
