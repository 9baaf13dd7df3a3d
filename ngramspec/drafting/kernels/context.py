"""numba kernels of the per-request context index (drafting/index/context.py owns the arrays).

Per request: `tok` (tokens), `hashes` (the hashes of the windows ending at the last token, the
same wrapping polynomial hash as tests/oracles/context.py), one open-addressing table
(window hash, length) -> (latest end position, occurrences), and `prev[pos * max_match + m - 1]`,
the previous end position of the m-window ending at pos. The chain from the newest token lists the
earlier occurrences of each suffix newest first, which is what the reference's `anchors` returns
(oldest first).
A table entry is one 16-byte record, uint64 [key, value]: key = hash << 7 | length (0: empty),
value = occurrences << 32 | latest end. Every appended token probes up to max_match windows at
random places of a table that outgrows the cache, so a probe costs its cache misses: one record
(one cache line) a probe rather than three parallel arrays.
`st` (int64): number of tokens, number of live hashes, table entries, then the occurrence count
of each suffix (so anchors need not walk chains to count).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.kernels import hashtab as ht

HASH_BASE = 0x100000001B3  # odd, so multiplication is a bijection mod 2**64
LENGTH_BITS = 7  # window lengths <= 127 live in the key's low bits

NUM, NUM_HASHES, ENTRIES, SUFFIX_COUNTS = range(4)  # st[SUFFIX_COUNTS + m - 1]: m-suffix count


@njit(cache=True, inline="always")
def _home(key: np.uint64, mask: int) -> int:
    m = np.int64(key & np.uint64((1 << LENGTH_BITS) - 1))
    return np.int64(((key >> np.uint64(LENGTH_BITS)) ^ ht.mix(m)) & np.uint64(mask))


@njit(cache=True, inline="always")
def _slot(table: np.ndarray, key: np.uint64) -> int:
    """Slot of `key`, or the empty slot where it would go."""
    mask = table.shape[0] - 1
    i = _home(key, mask)
    while table[i, 0] != 0 and table[i, 0] != key:
        i = (i + 1) & mask
    return i


@njit(cache=True, inline="always")
def append(tok: np.ndarray, prev: np.ndarray, hashes: np.ndarray, table: np.ndarray,
           st: np.ndarray, new: np.ndarray) -> None:
    """Index `new`: each window's record gets the new latest end and one more occurrence."""
    max_match = hashes.shape[0]
    base = np.uint64(HASH_BASE)
    low = np.uint64(0xFFFFFFFF)
    for t in new:
        pos = st[NUM]
        tok[pos] = t
        st[NUM] = pos + 1
        if t == SEPARATOR:
            st[NUM_HASHES] = 0
            continue
        value = np.uint64(t + 1)  # keep token 0 from hashing like "nothing"
        nh = min(st[NUM_HASHES] + 1, max_match)
        for m in range(nh - 1, 0, -1):
            hashes[m] = hashes[m - 1] * base + value
        hashes[0] = value
        st[NUM_HASHES] = nh
        mask = table.shape[0] - 1
        for m in range(nh):  # every window's slot at once: their misses overlap
            ht.prefetch(table, _home((hashes[m] << np.uint64(LENGTH_BITS)) | np.uint64(m + 1),
                                     mask))
        for m in range(nh):
            key = (hashes[m] << np.uint64(LENGTH_BITS)) | np.uint64(m + 1)
            i = _slot(table, key)
            if table[i, 0] == 0:
                table[i, 0] = key
                prev[pos * max_match + m] = -1
                count = np.uint64(1)
                st[ENTRIES] += 1
            else:
                prev[pos * max_match + m] = np.int64(table[i, 1] & low)
                count = (table[i, 1] >> np.uint64(32)) + np.uint64(1)
            table[i, 1] = (count << np.uint64(32)) | np.uint64(pos)
            st[SUFFIX_COUNTS + m] = np.int64(count)


@njit(cache=True)
def rehash(table: np.ndarray, new_table: np.ndarray) -> None:
    for i in range(table.shape[0]):
        if table[i, 0] != 0:
            j = _slot(new_table, table[i, 0])
            new_table[j, 0], new_table[j, 1] = table[i, 0], table[i, 1]


@njit(cache=True, inline="always")
def _anchor(prev: np.ndarray, end: int, m: int, max_match: int, num: int, out_len: np.ndarray,
            out_start: np.ndarray, out_num: np.ndarray, pool: np.ndarray, k: int,
            pool_used: int) -> int:
    """Anchor k: the `num` latest earlier ends of the m-window ending at `end`, oldest first, as
    the pool segment at pool_used (walked along `prev`); returns the pool entries used after."""
    q = prev[end * max_match + m - 1]
    for i in range(num - 1, -1, -1):
        pool[pool_used + i] = q
        q = prev[q * max_match + m - 1]
    out_len[k], out_start[k], out_num[k] = m, pool_used, num
    return pool_used + num


@njit(cache=True, inline="always")
def anchors_at(tok: np.ndarray, prev: np.ndarray, end: int, max_match: int, max_anchors: int,
               max_occurrences: int, out_len: np.ndarray, out_start: np.ndarray,
               out_num: np.ndarray, pool: np.ndarray, pool_used: int) -> tuple:
    """`anchors` of the suffix ending at position `end` instead of the newest token
    (ReferenceContextIndex.anchors_at): no counts are kept for it, so each window's earlier
    ends are counted along its `prev` chain, `max_occurrences` at most."""
    k, last = 0, 0
    if end < 0:
        return k, pool_used
    windows = 0  # the windows ending at `end`: none spans a separator
    while windows < max_match and windows <= end and tok[end - windows] != SEPARATOR:
        windows += 1
    for m in range(windows, 0, -1):
        num, q = 0, prev[end * max_match + m - 1]
        while q >= 0 and num < max_occurrences:
            num += 1
            q = prev[q * max_match + m - 1]
        if num <= last:
            continue
        pool_used = _anchor(prev, end, m, max_match, num, out_len, out_start, out_num, pool, k,
                            pool_used)
        k, last = k + 1, num
        if k == max_anchors or num >= max_occurrences:
            break
    return k, pool_used


@njit(cache=True, inline="always")
def anchors(prev: np.ndarray, st: np.ndarray, max_match: int, max_anchors: int,
            max_occurrences: int, out_len: np.ndarray, out_start: np.ndarray,
            out_num: np.ndarray, pool: np.ndarray, pool_used: int) -> tuple:
    """ReferenceContextIndex.anchors: (m, earlier ends oldest first) written as pool segments.

    Returns (number of anchors, pool entries used after them).
    """
    k, last = 0, 0
    newest = st[NUM] - 1
    for m in range(st[NUM_HASHES], 0, -1):
        count = st[SUFFIX_COUNTS + m - 1] - 1  # the last occurrence is the suffix itself
        if count <= last:
            continue
        pool_used = _anchor(prev, newest, m, max_match, min(count, max_occurrences), out_len,
                            out_start, out_num, pool, k, pool_used)
        k, last = k + 1, count
        if k == max_anchors or count >= max_occurrences:
            break
    return k, pool_used
