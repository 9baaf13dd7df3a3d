"""ContextIndex: the per-request index over its own tokens (references, prompt, output).

For every window length m <= max_match it finds the earlier occurrences of the suffix that ends
at the newest token, so a request can copy from its own prompt from the first decode step. The
arrays live here and the native kernels (drafting/kernels/drafter.cpp `Context`) read and grow them in place:
`tok` (tokens), `hashes` (the hashes of the windows ending at the last token), one
open-addressing table (window hash, length) -> (latest end, occurrences) of 16-byte records, and
`prev`, the chain of earlier ends per window. `anchors()` lists matched suffix lengths longest first with their
earlier ends oldest first; windows never contain a separator, so matches stay inside one
document. tests/oracles/context.py is the dict-based reference.

NOTE: windows are compared by a polynomial hash mod 2**64; a collision (~5e-20 per pair; windows
are at most max_match tokens) would only cost a rejected draft, never a wrong output.
"""

from __future__ import annotations

import numpy as np

from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.kernels import layout as lay
from ngramspec.drafting.kernels import native


class ContextIndex:
    def __init__(self, max_match: int, max_occurrences: int) -> None:
        if max_match < 1 or max_occurrences < 1:
            raise ValueError("max_match and max_occurrences must be >= 1")
        if max_match > 127:
            raise ValueError("the index keeps window lengths in 7 bits of its keys: "
                             "max_match <= 127")
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.st = np.zeros(lay.SUFFIX_COUNTS + max_match, np.int64)
        self.hashes = np.zeros(max_match, np.uint64)
        self.tok = np.zeros(256, np.int32)
        self.prev = np.zeros(256 * max_match, np.int32)
        self.table = np.zeros((lay.table_size(1024), 2), np.uint64)  # drafter.cpp Context
        # Python-side mirrors for the growth checks of `reserve` (numpy scalar reads are slow),
        # as of its last full check; `_room` of the `_granted` tokens that check found room for
        # are left (so the tokens reserved are _num + _granted - _room).
        self._num = 0
        self._entries_bound = 0  # >= table entries: every token adds at most max_match
        self._room = self._granted = 0

    def __len__(self) -> int:
        return int(self.st[lay.C_NUM])

    @property
    def tokens(self) -> np.ndarray:
        """A view of the tokens so far (valid until the next extend)."""
        return self.tok[: self.st[lay.C_NUM]]

    def add_document(self, tokens: list[int]) -> None:
        self.extend(tokens)
        self.extend([SEPARATOR])

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32)
        self.reserve(len(new))
        native().context_append(self.tok, self.prev, self.hashes, self.table, self.st, new)

    def reserve(self, count: int) -> bool:
        """Room for `count` more tokens; the caller then appends exactly `count` tokens, maybe
        later (the drafter queues its appends: kernels/drafter.cpp `propose`). True when the arrays were
        replaced (their holders must take the new ones)."""
        if count <= self._room:  # within what the last check found: ~0.1 µs less a commit
            self._room -= count
            return False
        count += self._granted - self._room
        grew = self._grow_for(count)
        tokens = len(self.tok) - self._num
        entries = (3 * len(self.table) - 4 * self._entries_bound) // (4 * self.max_match)
        self._room = self._granted = max(0, min(tokens, entries))
        return grew

    def _grow_for(self, count: int) -> bool:
        """The full check of `reserve`: the arrays grown (True) when `count` more tokens would
        not fit, or fill the table past 3/4."""
        self._num += count
        grew = False
        if self._num > len(self.tok):
            size = max(self._num, 2 * len(self.tok))
            self.tok = _grown(self.tok, size)
            self.prev = _grown(self.prev, size * self.max_match)
            grew = True
        self._entries_bound += count * self.max_match
        if self._entries_bound * 4 <= len(self.table) * 3:
            return grew
        # Entries now, plus the most that every reserved but not yet appended token can add.
        self._entries_bound = (int(self.st[lay.ENTRIES])
                               + (self._num - int(self.st[lay.C_NUM])) * self.max_match)
        if self._entries_bound * 4 > len(self.table) * 3:
            table = np.zeros((lay.table_size(2 * self._entries_bound), 2), np.uint64)
            native().context_rehash(self.table, table)
            self.table = table
            grew = True
        return grew

    def arrays(self) -> tuple[np.ndarray, ...]:
        """tok, prev, hashes, table, st: what the kernels read (kernels/layout.py F_*)."""
        return self.tok, self.prev, self.hashes, self.table, self.st

    def anchors(self, max_anchors: int) -> list[tuple[int, list[int]]]:
        """Same result as the reference (tests/oracles/context.py)."""
        return self._anchors(-1, max_anchors)

    def anchors_at(self, end: int, max_anchors: int) -> list[tuple[int, list[int]]]:
        """`anchors` of the suffix ending at position `end` (a wildcard match's), as the
        reference's; used by the tests."""
        return self._anchors(end, max_anchors) if end >= 0 else []

    def _anchors(self, end: int, max_anchors: int) -> list[tuple[int, list[int]]]:
        """The kernel's anchors of the suffix ending at `end` (-1: the newest token's)."""
        k = max(1, max_anchors)
        out = (np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64),
               np.zeros(k * self.max_occurrences, np.int64))
        found = native().context_anchors(self.tok, self.prev, self.st, end, self.max_match,
                                         max_anchors, self.max_occurrences, *out)
        return _segments(found, *out)

    def continuations(self, ends: list[int], offset: int) -> dict[int, list[int]]:
        """Same result as the reference (tests/oracles/context.py); used by the lockstep tests."""
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


def _segments(found: int, lens: np.ndarray, starts: np.ndarray, nums: np.ndarray,
              pool: np.ndarray) -> list[tuple[int, list[int]]]:
    """The kernels' anchors as (length, earlier ends oldest first)."""
    return [(int(lens[i]), pool[starts[i]: starts[i] + nums[i]].tolist()) for i in range(found)]
