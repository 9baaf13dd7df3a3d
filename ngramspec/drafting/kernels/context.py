"""numba kernels of the per-request context index (drafting/index/context.py owns the arrays).

Per request: `tok` (tokens), `hashes` (the hashes of the windows ending at the last token, the
same wrapping polynomial hash as tests/oracles/context.py), one open-addressing table
(window hash, length) -> latest end position, and `prev[pos * max_match + m - 1]`, the previous end position of the
m-window ending at pos. The chain from the newest token lists the earlier occurrences of each
suffix newest first, which is what the reference's `anchors` returns (oldest first).
`st` (int64): number of tokens, number of live hashes, table entries, then the occurrence count
of each suffix (so anchors need not walk chains to count).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.kernels import hashtab as ht

HASH_BASE = 0x100000001B3  # odd, so multiplication is a bijection mod 2**64

NUM, NUM_HASHES, ENTRIES, SUFFIX_COUNTS = range(4)  # st[SUFFIX_COUNTS + m - 1]: m-suffix count


@njit(cache=True)
def _slot(keys: np.ndarray, lens: np.ndarray, h: np.uint64, m: int) -> int:
    """Slot of (h, m), or the empty slot where it would go."""
    mask = keys.shape[0] - 1
    i = np.int64((h ^ ht.mix(np.int64(m))) & np.uint64(mask))
    while lens[i] != 0 and (lens[i] != m or keys[i] != h):
        i = (i + 1) & mask
    return i


@njit(cache=True)
def append(tok: np.ndarray, prev: np.ndarray, hashes: np.ndarray, keys: np.ndarray,
           lens: np.ndarray, vals: np.ndarray, st: np.ndarray, new: np.ndarray) -> None:
    """Index `new`; vals[slot] = (latest end position, occurrences so far) per window."""
    max_match = hashes.shape[0]
    base = np.uint64(HASH_BASE)
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
        for m in range(nh):
            i = _slot(keys, lens, hashes[m], m + 1)
            if lens[i] == 0:
                keys[i], lens[i] = hashes[m], m + 1
                prev[pos * max_match + m] = -1
                vals[i, 1] = 0
                st[ENTRIES] += 1
            else:
                prev[pos * max_match + m] = vals[i, 0]
            vals[i, 0] = pos
            vals[i, 1] += 1
            st[SUFFIX_COUNTS + m] = vals[i, 1]


@njit(cache=True)
def rehash(keys: np.ndarray, lens: np.ndarray, vals: np.ndarray, new_keys: np.ndarray,
           new_lens: np.ndarray, new_vals: np.ndarray) -> None:
    for i in range(keys.shape[0]):
        if lens[i] != 0:
            j = _slot(new_keys, new_lens, keys[i], lens[i])
            new_keys[j], new_lens[j] = keys[i], lens[i]
            new_vals[j, 0], new_vals[j, 1] = vals[i, 0], vals[i, 1]


@njit(cache=True)
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
        kept = min(count, max_occurrences)
        q = prev[newest * max_match + m - 1]
        for i in range(kept - 1, -1, -1):  # oldest first
            pool[pool_used + i] = q
            q = prev[q * max_match + m - 1]
        out_len[k], out_start[k], out_num[k] = m, pool_used, kept
        pool_used += kept
        k += 1
        last = count
        if k == max_anchors or count >= max_occurrences:
            break
    return k, pool_used
