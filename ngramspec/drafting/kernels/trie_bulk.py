"""numba kernels of the fast trie's bulk operations: re-hashing, listing, saving, loading."""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.kernels import hashtab as ht
from ngramspec.drafting.kernels.trie import (
    CNT,
    FIRST,
    LINKED,
    LNEXT,
    LRU_HEAD,
    NEXT,
    NUM,
    PAR,
    PREV,
    ROOT,
    TOK,
    VER,
    _append_child,
    _lru_append,
    _same_after,
    _same_before,
    stamp_order,
)


@njit(cache=True)
def rehash(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, num: int) -> None:
    edges[:] = -1
    runs[:] = -1
    for n in range(1, num):
        if cols[cols[n, PAR], FIRST] != n or cols[n, NEXT] != -1:  # only siblings have entries
            ht.insert(edges, n, ht.pair_key(cols[n, PAR], cols[n, TOK]))
        c = cols[n, CNT]
        if _same_after(cols, n, c) and not _same_before(cols, n, c):
            ht.insert(runs, n, ht.pair_key(cols[n, PAR], c))


@njit(cache=True)
def children(cols: np.ndarray, node: int, limit: int) -> np.ndarray:
    """[k, 3] rows (token, child, count), most frequent first."""
    k = 0
    c = cols[node, FIRST]
    while c != -1 and k < limit:
        k += 1
        c = cols[c, NEXT]
    out = np.empty((k, 3), np.int64)
    c = cols[node, FIRST]
    for i in range(k):
        out[i, 0], out[i, 1], out[i, 2] = cols[c, TOK], c, cols[c, CNT]
        c = cols[c, NEXT]
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
        c = cols[order[i], FIRST]
        while c != -1:
            order[size], index[c] = c, size
            size += 1
            c = cols[c, NEXT]
    if not meta[LINKED]:  # stamp mode (kernels/trie.py): the leaves by stamp
        leaves = stamp_order(cols, num)
        lru = np.empty(leaves.shape[0], np.int64)
        for k in range(leaves.shape[0]):
            lru[k] = index[leaves[k]]
        return order[:size], index, lru
    lru = np.empty(num, np.int64)
    k = 0
    n = meta[LRU_HEAD]
    while n != -1:
        lru[k] = index[n]
        k += 1
        n = cols[n, LNEXT]
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
        first = cols[p, FIRST]
        if first != -1 and cols[cols[first, PREV], CNT] < counts[n]:
            return n  # siblings must come in count order
        cols[n, TOK], cols[n, PAR], cols[n, CNT], cols[n, VER] = tokens[n], p, counts[n], 1
        cols[n, FIRST] = -1
        if first != -1:
            last = cols[first, PREV]
            if cols[last, CNT] == counts[n] and not _same_before(cols, last, counts[n]):
                ht.insert(runs, last, ht.pair_key(p, counts[n]))
        _append_child(cols, p, n)
    for n in range(1, num):
        if cols[cols[n, PAR], FIRST] != n or cols[n, NEXT] != -1:  # only siblings have entries
            ht.insert(edges, n, ht.pair_key(parents[n], tokens[n]))
    meta[NUM] = num
    meta[LINKED] = 1  # the file's order, as a list
    for i in range(lru.shape[0]):
        n = lru[i]
        if not 0 < n < num:
            return num + i
        _lru_append(cols, meta, n)
    return 0
