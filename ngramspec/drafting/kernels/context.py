"""FastContextIndex: drafting/oracle/context.py on numpy arrays and numba kernels.

Per request: `tok` (tokens), `hashes` (the hashes of the windows ending at the last token, the
same wrapping polynomial hash as ContextIndex), one open-addressing table (window hash, length)
-> latest end position, and `prev[pos * max_match + m - 1]`, the previous end position of the
m-window ending at pos. The chain from the newest token lists the earlier occurrences of each
suffix newest first, which is what `ContextIndex.anchors` returns (oldest first).
`st` (int64): number of tokens, number of live hashes, table entries, then the occurrence count
of each suffix (so anchors need not walk chains to count).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.oracle.context import HASH_BASE
from ngramspec.drafting.kernels import hashtab as ht
from ngramspec.drafting.index.sam import SEPARATOR

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
    """ContextIndex.anchors: (m, earlier ends oldest first) written as pool segments.

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


class FastContextIndex:
    def __init__(self, max_match: int, max_occurrences: int) -> None:
        if max_match < 1 or max_occurrences < 1:
            raise ValueError("max_match and max_occurrences must be >= 1")
        if max_match > 127:
            raise ValueError("the fast index stores window lengths as int8: max_match <= 127")
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.st = np.zeros(SUFFIX_COUNTS + max_match, np.int64)
        self.hashes = np.zeros(max_match, np.uint64)
        self.tok = np.zeros(256, np.int32)
        self.prev = np.zeros(256 * max_match, np.int32)
        size = ht.table_size(1024)
        self.keys = np.zeros(size, np.uint64)
        self.lens = np.zeros(size, np.int8)
        self.vals = np.zeros((size, 2), np.int32)
        # Python-side mirrors for the growth checks of `reserve` (numpy scalar reads are slow).
        self._num = 0
        self._entries_bound = 0  # >= table entries: every token adds at most max_match

    def __len__(self) -> int:
        return int(self.st[NUM])

    @property
    def tokens(self) -> np.ndarray:
        """A view of the tokens so far (valid until the next extend)."""
        return self.tok[: self.st[NUM]]

    def add_document(self, tokens: list[int]) -> None:
        self.extend(tokens)
        self.extend([SEPARATOR])

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32)
        self.reserve(len(new))
        append(self.tok, self.prev, self.hashes, self.keys, self.lens, self.vals, self.st, new)

    def reserve(self, count: int) -> None:
        """Room for `count` more tokens; the caller then appends exactly `count` tokens."""
        self._num += count
        if self._num > len(self.tok):
            size = max(self._num, 2 * len(self.tok))
            self.tok = _grown(self.tok, size)
            self.prev = _grown(self.prev, size * self.max_match)
        self._entries_bound += count * self.max_match
        if self._entries_bound * 4 <= len(self.keys) * 3:
            return
        self._entries_bound = int(self.st[ENTRIES]) + count * self.max_match
        if self._entries_bound * 4 > len(self.keys) * 3:
            size = ht.table_size(2 * self._entries_bound)
            keys, lens = np.zeros(size, np.uint64), np.zeros(size, np.int8)
            vals = np.zeros((size, 2), np.int32)
            rehash(self.keys, self.lens, self.vals, keys, lens, vals)
            self.keys, self.lens, self.vals = keys, lens, vals

    def anchors(self, max_anchors: int) -> list[tuple[int, list[int]]]:
        """Same result as ContextIndex.anchors."""
        k = max(1, max_anchors)
        lens, starts, nums = (np.zeros(k, np.int64) for _ in range(3))
        pool = np.zeros(k * self.max_occurrences, np.int64)
        found, _ = anchors(self.prev, self.st, self.max_match, max_anchors,
                           self.max_occurrences, lens, starts, nums, pool, 0)
        return [(int(lens[i]), pool[starts[i]: starts[i] + nums[i]].tolist())
                for i in range(found)]

    def continuations(self, ends: list[int], offset: int) -> dict[int, list[int]]:
        """Same result as ContextIndex.continuations."""
        tokens = self.tokens
        n = len(tokens)
        groups: dict[int, list[int]] = {}
        for end in ends:
            at = end + offset + 1
            if at < n:
                token = int(tokens[at])
                if token != SEPARATOR:
                    groups.setdefault(token, []).append(end)
        return groups


def _grown(a: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, a.dtype)
    out[: len(a)] = a
    return out
