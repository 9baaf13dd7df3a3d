"""numba kernels of the fast global trie (see fast/trie.py for the layout and the semantics).

Node columns (`cols`, int32 [NUM_COLS, allocated]):
  TOK, PAR, CNT         token, parent, occurrence count
  FIRST, NEXT, PREV     children as a linked list sorted by count desc; PREV of the first child
                        is the last child (O(1) append), NEXT of the last is -1
  LPREV, LNEXT          the leaf LRU list (front = least recently touched)
  VER                   bumped when the id is evicted, so request anchors can tell staleness
Two id-only hash tables (fast/hashtab.py): `edges` keyed (PAR, TOK) and `runs` keyed (PAR, CNT),
the latter holding the FIRST child of each run of equal-count siblings. The run head is what
`NgramTrie._bubble_up` finds by bisection: an incremented child swaps with it (same tie-breaking).
`meta` (int64): NUM, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH.
A request state (int32 [1 + 2 * depth]): count, anchors[depth], versions[depth].
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.spec.fast import hashtab as ht

TOK, PAR, CNT, FIRST, NEXT, PREV, LPREV, LNEXT, VER = range(9)
NUM_COLS = 9
NUM, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH = range(6)
SEPARATOR = -(2**31)
ROOT = 0


# ---------------------------------------------------------------- sibling list


@njit(cache=True)
def _unlink(cols: np.ndarray, x: int) -> None:
    p, nx, pv = cols[PAR, x], cols[NEXT, x], cols[PREV, x]
    first = cols[FIRST, p]
    if first == x:
        cols[FIRST, p] = nx
        if nx != -1:
            cols[PREV, nx] = pv  # pv is the last child
    else:
        cols[NEXT, pv] = nx
        if nx == -1:
            cols[PREV, first] = pv
        else:
            cols[PREV, nx] = pv


@njit(cache=True)
def _insert_after(cols: np.ndarray, x: int, y: int) -> None:
    nx = cols[NEXT, y]
    cols[NEXT, y], cols[PREV, x], cols[NEXT, x] = x, y, nx
    if nx == -1:
        cols[PREV, cols[FIRST, cols[PAR, y]]] = x
    else:
        cols[PREV, nx] = x


@njit(cache=True)
def _insert_before(cols: np.ndarray, x: int, y: int) -> None:
    p = cols[PAR, y]
    if cols[FIRST, p] == y:
        cols[PREV, x], cols[NEXT, x] = cols[PREV, y], y
        cols[PREV, y], cols[FIRST, p] = x, x
    else:
        _insert_after(cols, x, cols[PREV, y])


@njit(cache=True)
def _append_child(cols: np.ndarray, p: int, x: int) -> None:
    first = cols[FIRST, p]
    cols[NEXT, x] = -1
    if first == -1:
        cols[FIRST, p], cols[PREV, x] = x, x
    else:
        last = cols[PREV, first]
        cols[NEXT, last], cols[PREV, x], cols[PREV, first] = x, last, x


@njit(cache=True)
def _swap(cols: np.ndarray, a: int, b: int) -> None:
    """Exchange the list positions of siblings a (earlier) and b (later)."""
    if cols[NEXT, a] == b:
        _unlink(cols, a)
        _insert_after(cols, a, b)
        return
    after_a, before_b = cols[NEXT, a], cols[PREV, b]
    _unlink(cols, b)
    _insert_before(cols, b, after_a)
    _unlink(cols, a)
    _insert_after(cols, a, before_b)


# ---------------------------------------------------------------- leaf LRU


@njit(cache=True)
def _lru_remove(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    p, x = cols[LPREV, n], cols[LNEXT, n]
    if p != -1:
        cols[LNEXT, p] = x
    else:
        meta[LRU_HEAD] = x
    if x != -1:
        cols[LPREV, x] = p
    else:
        meta[LRU_TAIL] = p


@njit(cache=True)
def _lru_append(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    tail = meta[LRU_TAIL]
    cols[LPREV, n], cols[LNEXT, n] = tail, -1
    if tail != -1:
        cols[LNEXT, tail] = n
    else:
        meta[LRU_HEAD] = n
    meta[LRU_TAIL] = n


@njit(cache=True)
def _lru_push_front(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    head = meta[LRU_HEAD]
    cols[LPREV, n], cols[LNEXT, n] = -1, head
    if head != -1:
        cols[LPREV, head] = n
    else:
        meta[LRU_TAIL] = n
    meta[LRU_HEAD] = n


# ---------------------------------------------------------------- counting


@njit(cache=True)
def _is_run_head(cols: np.ndarray, n: int) -> bool:
    p = cols[PAR, n]
    return cols[FIRST, p] == n or cols[CNT, cols[PREV, n]] != cols[CNT, n]


@njit(cache=True)
def _increment(cols: np.ndarray, runs: np.ndarray, child: int) -> None:
    """count += 1, then swap with the head of the old count's run (NgramTrie._bubble_up)."""
    p, c = cols[PAR, child], cols[CNT, child] + 1
    head = ht.find(runs, cols, PAR, CNT, p, c - 1)
    if head != child:
        _swap(cols, head, child)
    nx = cols[NEXT, child]
    if nx != -1 and cols[CNT, nx] == c - 1:
        ht.replace(runs, cols, PAR, CNT, head, nx)
    else:
        ht.remove(runs, cols, PAR, CNT, head)
    cols[CNT, child] = c
    if cols[FIRST, p] == child or cols[CNT, cols[PREV, child]] != c:
        ht.insert(runs, child, ht.pair_key(p, c))


@njit(cache=True)
def _pinned(n: int, parent: int, old: np.ndarray, num_old: int, new: np.ndarray,
            num_new: int) -> bool:
    if n == parent:
        return True
    for i in range(num_old):
        if old[i] == n:
            return True
    for i in range(num_new):
        if new[i] == n:
            return True
    return False


@njit(cache=True)
def _evict(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
           v: int) -> None:
    _lru_remove(cols, meta, v)
    p = cols[PAR, v]
    if _is_run_head(cols, v):
        nx = cols[NEXT, v]
        if nx != -1 and cols[CNT, nx] == cols[CNT, v]:
            ht.replace(runs, cols, PAR, CNT, v, nx)
        else:
            ht.remove(runs, cols, PAR, CNT, v)
    _unlink(cols, v)
    ht.remove(edges, cols, PAR, TOK, v)
    if cols[FIRST, p] == -1 and p != ROOT:
        # Its whole subtree went cold, so it is the next eviction candidate.
        _lru_push_front(cols, meta, p)
    cols[VER, v] += 1
    meta[EVICTED] += 1


@njit(cache=True)
def _allocate(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
              parent: int, old: np.ndarray, num_old: int, new: np.ndarray, num_new: int) -> int:
    num = meta[NUM]
    if num < cols.shape[1]:
        meta[NUM] = num + 1
        cols[VER, num] = 1
        return num
    if num < meta[CAPACITY]:
        return -2  # the caller did not grow the columns first (a bug)
    v = meta[LRU_HEAD]
    while v != -1 and _pinned(v, parent, old, num_old, new, num_new):
        v = cols[LNEXT, v]
    if v == -1:
        return -1
    _evict(cols, edges, runs, meta, v)
    return v


@njit(cache=True)
def _count_child(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
                 parent: int, token: int, old: np.ndarray, num_old: int, new: np.ndarray,
                 num_new: int) -> int:
    child = ht.find(edges, cols, PAR, TOK, parent, token)
    if child >= 0:
        _increment(cols, runs, child)
        if cols[FIRST, child] == -1 and meta[LRU_TAIL] != child:
            _lru_remove(cols, meta, child)
            _lru_append(cols, meta, child)
        return child
    node = _allocate(cols, edges, runs, meta, parent, old, num_old, new, num_new)
    if node < 0:
        return node
    cols[TOK, node], cols[PAR, node], cols[CNT, node], cols[FIRST, node] = token, parent, 1, -1
    first = cols[FIRST, parent]
    if first == -1:
        if parent != ROOT:
            _lru_remove(cols, meta, parent)  # no longer a leaf
        ht.insert(runs, node, ht.pair_key(parent, 1))
    elif cols[CNT, cols[PREV, first]] != 1:
        ht.insert(runs, node, ht.pair_key(parent, 1))
    _append_child(cols, parent, node)
    ht.insert(edges, node, ht.pair_key(parent, token))
    _lru_append(cols, meta, node)
    return node


# ---------------------------------------------------------------- request anchors


@njit(cache=True)
def lookup(cols: np.ndarray, edges: np.ndarray, ctx: np.ndarray, lo: int, hi: int) -> int:
    node = ROOT
    for i in range(lo, hi):
        node = ht.find(edges, cols, PAR, TOK, node, ctx[i])
        if node < 0:
            return -1
    return node


@njit(cache=True)
def run_length(ctx: np.ndarray, n: int, cap: int) -> int:
    """Tokens after the last separator in ctx[:n], at most `cap`."""
    lo = max(-1, n - 1 - cap)
    for i in range(n - 1, lo, -1):
        if ctx[i] == SEPARATOR:
            return n - 1 - i
    return min(cap, n)


@njit(cache=True)
def refresh(cols: np.ndarray, edges: np.ndarray, meta: np.ndarray, state: np.ndarray,
            ctx: np.ndarray, n: int) -> None:
    """Re-probe the stale or missing suffix anchors of ctx[:n] (NgramTrie._refresh)."""
    depth = meta[DEPTH]
    limit = run_length(ctx, n, depth)
    if state[0] > limit:
        state[0] = limit
    for k in range(limit):
        if k < state[0]:
            a = state[1 + k]
            if a >= 0 and cols[VER, a] == state[1 + depth + k]:
                continue
        else:
            state[0] = k + 1
        a = lookup(cols, edges, ctx, n - k - 1, n)
        state[1 + k] = a
        state[1 + depth + k] = cols[VER, a] if a >= 0 else 0


@njit(cache=True)
def extend(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
           state: np.ndarray, ctx: np.ndarray, start: int, end: int) -> int:
    """Count the n-grams ending at ctx[start:end] (NgramTrie._advance per token); 0 or -2."""
    depth = meta[DEPTH]
    old = np.empty(depth, np.int32)
    new = np.empty(depth, np.int32)
    for pos in range(start, end):
        token = ctx[pos]
        if token == SEPARATOR:  # n-grams never span documents
            state[0] = 0
            continue
        num_old = state[0]
        for i in range(num_old):
            old[i] = state[1 + i]
        num_new = 0
        for k in range(min(depth, pos + 1)):
            if k == 0:
                parent = ROOT
            elif k <= num_old and old[k - 1] >= 0 and cols[VER, old[k - 1]] == state[depth + k]:
                parent = old[k - 1]
            else:  # evicted or never stored: re-probe the k tokens before `token`
                if ctx[pos - k] == SEPARATOR:
                    break
                parent = lookup(cols, edges, ctx, pos - k, pos)
                if parent < 0:
                    break
            child = _count_child(cols, edges, runs, meta, parent, token, old, num_old, new,
                                 num_new)
            if child == -2:
                return -2
            if child < 0:
                break
            new[num_new] = child
            num_new += 1
        state[0] = num_new
        for i in range(num_new):
            state[1 + i] = new[i]
            state[1 + depth + i] = cols[VER, new[i]]
    return 0


# ---------------------------------------------------------------- bulk operations


@njit(cache=True)
def rehash(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, num: int) -> None:
    edges[:] = -1
    runs[:] = -1
    for n in range(1, num):
        ht.insert(edges, n, ht.pair_key(cols[PAR, n], cols[TOK, n]))
        if _is_run_head(cols, n):
            ht.insert(runs, n, ht.pair_key(cols[PAR, n], cols[CNT, n]))


@njit(cache=True)
def children(cols: np.ndarray, node: int, limit: int) -> np.ndarray:
    """[k, 3] rows (token, child, count), most frequent first."""
    k = 0
    c = cols[FIRST, node]
    while c != -1 and k < limit:
        k += 1
        c = cols[NEXT, c]
    out = np.empty((k, 3), np.int64)
    c = cols[FIRST, node]
    for i in range(k):
        out[i, 0], out[i, 1], out[i, 2] = cols[TOK, c], c, cols[CNT, c]
        c = cols[NEXT, c]
    return out


@njit(cache=True)
def bfs_order(cols: np.ndarray, meta: np.ndarray) -> tuple:
    """Live nodes parents-first (children in list order), their BFS index, and the LRU."""
    num = meta[NUM]
    order = np.empty(num, np.int64)
    index = np.full(num, -1, np.int64)
    order[0], index[0] = ROOT, 0
    size = 1
    for i in range(num):
        if i >= size:
            break
        c = cols[FIRST, order[i]]
        while c != -1:
            order[size], index[c] = c, size
            size += 1
            c = cols[NEXT, c]
    lru = np.empty(num, np.int64)
    k = 0
    n = meta[LRU_HEAD]
    while n != -1:
        lru[k] = index[n]
        k += 1
        n = cols[LNEXT, n]
    return order[:size], index, lru[:k]


@njit(cache=True)
def restore(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
            tokens: np.ndarray, parents: np.ndarray, counts: np.ndarray,
            lru: np.ndarray) -> int:
    """Rebuild from BFS-order arrays; the first offending node index on bad input, else 0."""
    num = tokens.shape[0]
    for n in range(1, num):
        p = parents[n]
        if not 0 <= p < n or counts[n] < 1 or tokens[n] < 0:
            return n
        first = cols[FIRST, p]
        if first != -1 and cols[CNT, cols[PREV, first]] < counts[n]:
            return n  # siblings must come in count order
        cols[TOK, n], cols[PAR, n], cols[CNT, n], cols[VER, n] = tokens[n], p, counts[n], 1
        cols[FIRST, n] = -1
        if first == -1 or cols[CNT, cols[PREV, first]] != counts[n]:
            ht.insert(runs, n, ht.pair_key(p, counts[n]))
        _append_child(cols, p, n)
        ht.insert(edges, n, ht.pair_key(p, tokens[n]))
    meta[NUM] = num
    for i in range(lru.shape[0]):
        n = lru[i]
        if not 0 < n < num:
            return num + i
        _lru_append(cols, meta, n)
    return 0
