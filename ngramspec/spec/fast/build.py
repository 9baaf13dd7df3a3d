"""numba kernel of the drafter's best-first tree build (NgramDrafter._build).

`build` is NgramDrafter._build for the context and trie sources (no external corpora): the same
cursors, the same merge of equal tokens (first-seen order, the higher estimate wins), the same
heap keyed by (-path probability, push sequence) and the same evidence lists, so both backends
give identical trees. Cursors and candidates live in preallocated scratch (`Scratch`):
  cursor columns: SRC, A (trie node | pool start), B (pool length), OFF (context offset),
                  LEN (matched length), NEXT (next cursor of the same candidate)
  candidate columns: SLOT (parent node), TOK, SRC, HEAD, TAIL (its cursor list)
Context cursors keep their end positions as segments of `pool`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.spec.calibration import BUCKET_EDGES, MAX_CONDITIONAL
from ngramspec.spec.fast import context as cx
from ngramspec.spec.fast import trie_kernels as tk
from ngramspec.spec.sam import SEPARATOR
from ngramspec.spec.sources import CONTEXT, TRIE

C_SRC, C_A, C_B, C_OFF, C_LEN, C_NEXT = range(6)
K_SLOT, K_TOK, K_SRC, K_HEAD, K_TAIL = range(5)
# params: budget, top-k children per cursor, anchors per source, occurrences per context match
P_BUDGET, P_LIMIT, P_ANCHORS, P_OCC = range(4)
# counts (int64): next cursor, next candidate, heap size, pool used
N_CUR, N_CAND, N_HEAP, N_POOL = range(4)
BUCKETS = np.asarray(BUCKET_EDGES, np.int64)


class Scratch:
    """Work arrays of one build, sized for the worst case of a config."""

    def __init__(self, budget: int, limit: int, anchors: int, occurrences: int) -> None:
        root = 2 * anchors + 1
        cursors = root * (1 + (budget + 1) * limit) + 16
        self.cur = np.zeros((6, cursors), np.int64)
        self.raw = np.zeros(cursors, np.float64)
        self.cand = np.zeros((5, cursors), np.int64)
        self.cand_f = np.zeros((2, cursors), np.float64)  # estimate, -path probability
        self.heap = np.zeros(cursors, np.int64)
        self.pool = np.zeros(anchors * occurrences * (budget + 2) + 16, np.int64)
        # By group: token, size, first-seen id (sorted together); by end: group id; by
        # first-seen id: next pool slot.
        self.groups = np.zeros((5, occurrences + 1), np.int64)
        self.counts = np.zeros(4, np.int64)


@njit(cache=True, inline="always")
def bucket(length: int) -> int:
    b = 0
    while b < BUCKETS.shape[0] and BUCKETS[b] <= length - 1:
        b += 1
    return b


@njit(cache=True, inline="always")
def _estimate(factor: np.ndarray, calibrate: bool, src: int, length: int, raw: float) -> float:
    f = factor[src, bucket(length)] if calibrate else 1.0
    return min(MAX_CONDITIONAL, raw * f)


@njit(cache=True)
def _heap_less(cand_f: np.ndarray, a: int, b: int) -> bool:
    pa, pb = cand_f[1, a], cand_f[1, b]
    return pa < pb or (pa == pb and a < b)


@njit(cache=True)
def _heap_push(heap: np.ndarray, counts: np.ndarray, cand_f: np.ndarray, c: int) -> None:
    i = counts[N_HEAP]
    counts[N_HEAP] = i + 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _heap_less(cand_f, c, heap[parent]):
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = c


@njit(cache=True)
def _heap_pop(heap: np.ndarray, counts: np.ndarray, cand_f: np.ndarray) -> int:
    top = heap[0]
    size = counts[N_HEAP] - 1
    counts[N_HEAP] = size
    last = heap[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _heap_less(cand_f, heap[child + 1], heap[child]):
            child += 1
        if not _heap_less(cand_f, heap[child], last):
            break
        heap[i] = heap[child]
        i = child
    if size > 0:
        heap[i] = last
    return top


@njit(cache=True)
def _new_cursor(cur: np.ndarray, counts: np.ndarray, src: int, a: int, b: int, off: int,
                length: int) -> int:
    c = counts[N_CUR]
    counts[N_CUR] = c + 1
    cur[C_SRC, c], cur[C_A, c], cur[C_B, c] = src, a, b
    cur[C_OFF, c], cur[C_LEN, c], cur[C_NEXT, c] = off, length, -1
    return c


@njit(cache=True)
def _offer(s_cur, s_raw, s_cand, s_cand_f, counts, first_cand, slot, token, src, est, kid,
           raw) -> None:
    """Merge a continuation into this expansion's candidates (NgramDrafter._push_children)."""
    s_raw[kid] = raw
    for k in range(first_cand, counts[N_CAND]):
        if s_cand[K_TOK, k] == token:
            if est > s_cand_f[0, k]:
                s_cand_f[0, k], s_cand[K_SRC, k] = est, src
            s_cur[C_NEXT, s_cand[K_TAIL, k]] = kid
            s_cand[K_TAIL, k] = kid
            return
    k = counts[N_CAND]
    counts[N_CAND] = k + 1
    s_cand[K_SLOT, k], s_cand[K_TOK, k], s_cand[K_SRC, k] = slot, token, src
    s_cand[K_HEAD, k], s_cand[K_TAIL, k] = kid, kid
    s_cand_f[0, k] = est


@njit(cache=True)
def _context_groups(tok, n_tok, pool, start, num, off, groups) -> int:
    """Group the ends by the token `off + 1` after them; stable-sort groups by size desc."""
    g = 0
    for i in range(num):
        at = pool[start + i] + off + 1
        if at >= n_tok or tok[at] == SEPARATOR:
            groups[3, i] = -1
            continue
        t = tok[at]
        j = 0
        while j < g and groups[0, j] != t:
            j += 1
        if j == g:
            groups[0, g], groups[1, g], groups[2, g] = t, 0, g
            g += 1
        groups[1, j] += 1
        groups[3, i] = j
    for i in range(1, g):  # insertion sort: stable
        t, size, first = groups[0, i], groups[1, i], groups[2, i]
        j = i - 1
        while j >= 0 and groups[1, j] < size:
            groups[0, j + 1], groups[1, j + 1], groups[2, j + 1] = (
                groups[0, j], groups[1, j], groups[2, j])
            j -= 1
        groups[0, j + 1], groups[1, j + 1], groups[2, j + 1] = t, size, first
    return g


@njit(cache=True)
def _split_ends(pool, start, num, groups, g, take, counts) -> None:
    """Copy the ends of the `take` largest groups to the pool, group after group (one pass)."""
    for j in range(g):
        groups[4, j] = -1
    at = counts[N_POOL]
    for j in range(take):
        groups[4, groups[2, j]] = at
        at += groups[1, j]
    for i in range(num):
        gid = groups[3, i]
        if gid >= 0 and groups[4, gid] >= 0:
            pool[groups[4, gid]] = pool[start + i]
            groups[4, gid] += 1


@njit(cache=True)
def _push_children(cols, tok, n_tok, factor, calibrate, params, s_cur, s_raw, s_cand, s_cand_f,
                   heap, pool, groups, counts, slot, prob, head) -> None:
    limit = params[P_LIMIT]
    first_cand = counts[N_CAND]
    c = head
    while c != -1:
        src, length = s_cur[C_SRC, c], s_cur[C_LEN, c]
        if src == TRIE:
            node = s_cur[C_A, c]
            total = cols[node, tk.CNT]
            child = cols[node, tk.FIRST]
            taken = 0
            while child != -1 and taken < limit:
                raw = cols[child, tk.CNT] / (total + 1)
                est = _estimate(factor, calibrate, src, length, raw)
                kid = _new_cursor(s_cur, counts, src, child, 0, 0, length + 1)
                _offer(s_cur, s_raw, s_cand, s_cand_f, counts, first_cand, slot,
                       cols[child, tk.TOK], src, est, kid, raw)
                child = cols[child, tk.NEXT]
                taken += 1
        else:
            start, num, off = s_cur[C_A, c], s_cur[C_B, c], s_cur[C_OFF, c]
            g = _context_groups(tok, n_tok, pool, start, num, off, groups)
            take = min(g, limit)
            _split_ends(pool, start, num, groups, g, take, counts)
            for j in range(take):
                t, size = groups[0, j], groups[1, j]
                at = counts[N_POOL]
                counts[N_POOL] += size
                raw = size / (num + 1)
                est = _estimate(factor, calibrate, src, length, raw)
                kid = _new_cursor(s_cur, counts, src, at, size, off + 1, length + 1)
                _offer(s_cur, s_raw, s_cand, s_cand_f, counts, first_cand, slot, t, src, est,
                       kid, raw)
        c = s_cur[C_NEXT, c]
    for k in range(first_cand, counts[N_CAND]):
        s_cand_f[1, k] = -prob * s_cand_f[0, k]
        _heap_push(heap, counts, s_cand_f, k)


@njit(cache=True)
def _root_cursors(cols, edges, tmeta, tstate, trie_start, tok, prev, cst, max_match, params,
                  s_cur, pool, counts) -> int:
    """Context anchors, then distinct-count trie anchors (NgramDrafter._root_cursors)."""
    k_max = params[P_ANCHORS]
    m = np.empty(k_max, np.int64)
    starts = np.empty(k_max, np.int64)
    nums = np.empty(k_max, np.int64)
    found, used = cx.anchors(prev, cst, max_match, k_max, params[P_OCC], m, starts, nums, pool,
                             0)
    counts[N_POOL] = used
    head, tail = -1, -1
    for i in range(found):
        c = _new_cursor(s_cur, counts, CONTEXT, starts[i], nums[i], 0, m[i])
        if tail == -1:
            head = c
        else:
            s_cur[C_NEXT, tail] = c
        tail = c
    n = cst[cx.NUM]
    tk.refresh(cols, edges, tmeta, tstate, tok[trie_start:], n - trie_start)
    depth = tmeta[tk.DEPTH]
    last_count, num_trie = -1, 0
    for k in range(tstate[0] - 1, -1, -1):
        node = tstate[1 + k]
        if node < 0 or cols[node, tk.FIRST] == -1:
            continue
        count = cols[node, tk.CNT]
        if count != last_count and num_trie < k_max:
            # A shorter suffix with an equal count has the same occurrences: skip it.
            c = _new_cursor(s_cur, counts, TRIE, node, 0, 0, k + 1)
            if tail == -1:
                head = c
            else:
                s_cur[C_NEXT, tail] = c
            tail = c
            last_count, num_trie = count, num_trie + 1
    return head


@njit(cache=True)
def build(cols, edges, tmeta, tstate, trie_start, tok, prev, cst, max_match, factor, calibrate,
          params, min_path_prob, s_cur, s_raw, s_cand, s_cand_f, heap, pool, groups, counts,
          out_i, out_p, ev_i, ev_raw, ev_off, stats) -> int:
    """Fill out_i (token, parent, source rows), out_p and the evidence; returns the node count."""
    n_tok = cst[cx.NUM]
    counts[:] = 0
    out_i[0, 0], out_i[1, 0], out_i[2, 0], out_p[0] = tok[n_tok - 1], -1, -1, 1.0
    ev_off[0], ev_off[1] = 0, 0
    budget = params[P_BUDGET]
    if budget <= 0:
        return 1
    head = _root_cursors(cols, edges, tmeta, tstate, trie_start, tok, prev, cst, max_match,
                         params, s_cur, pool, counts)
    _push_children(cols, tok, n_tok, factor, calibrate, params, s_cur, s_raw, s_cand, s_cand_f,
                   heap, pool, groups, counts, 0, 1.0, head)
    n, e = 1, 0
    while counts[N_HEAP] > 0 and n <= budget:
        k = _heap_pop(heap, counts, s_cand_f)
        prob = -s_cand_f[1, k]
        if prob < min_path_prob:
            break
        src = s_cand[K_SRC, k]
        out_i[0, n], out_i[1, n], out_i[2, n] = s_cand[K_TOK, k], s_cand[K_SLOT, k], src
        out_p[n] = prob
        c = s_cand[K_HEAD, k]
        while c != -1:
            ev_i[0, e], ev_i[1, e], ev_raw[e] = s_cur[C_SRC, c], s_cur[C_LEN, c] - 1, s_raw[c]
            e += 1
            c = s_cur[C_NEXT, c]
        stats[src] += 1
        n += 1
        ev_off[n] = e
        if n <= budget:  # children of the last node could never be placed
            _push_children(cols, tok, n_tok, factor, calibrate, params, s_cur, s_raw, s_cand,
                           s_cand_f, heap, pool, groups, counts, n - 1, prob, s_cand[K_HEAD, k])
    return n
