"""Per-request index over its own tokens: reference documents, prompt and output.

For every length m <= max_match the index maps the rolling hash of each m-token window to the
list of positions where such a window ends. The windows ending at the newest token cost O(max_match)
to add, so a request can copy from its own prompt from the very first decode step.

`anchors()` returns, longest first, the suffix lengths that occurred before together with the end
positions of their earlier occurrences; the drafter grows a tree of all their continuations
(replay_findings lesson 2). Windows never contain a separator, so matches and continuations stay
inside one document.

NOTE: windows are compared by a polynomial hash mod 2**64 (wrapping uint64 arithmetic, so the native
index in drafting/kernels/drafter.cpp computes the very same values); a collision (~5e-20 per pair; windows
are at most max_match tokens, far too short for the Thue-Morse weakness of mod-2**64 hashing) would
only cost a rejected draft, never a wrong output.
"""

from __future__ import annotations

from array import array

from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.kernels.layout import HASH_BASE

HASH_MASK = (1 << 64) - 1


class ReferenceContextIndex:
    def __init__(self, max_match: int, max_occurrences: int) -> None:
        if max_match < 1 or max_occurrences < 1:
            raise ValueError("max_match and max_occurrences must be >= 1")
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        # Position lists are array('q'): invisible to the cyclic GC (see trie.py).
        self._tables: list[dict[int, array]] = [{} for _ in range(max_match)]
        self._hashes: list[int] = []  # _hashes[m-1]: hash of the m-window ending at the last token

    def __len__(self) -> int:
        return len(self.tokens)

    def add_document(self, tokens: list[int]) -> None:
        """A reference document: indexed, then closed with a separator."""
        self.extend(tokens)
        self.extend([SEPARATOR])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(token)
        if token == SEPARATOR:
            self._hashes = []
            return
        value = token + 1  # keep token 0 from hashing like "nothing"
        prev = self._hashes
        hashes = [value]
        hashes.extend((h * HASH_BASE + value) & HASH_MASK for h in prev[: self.max_match - 1])
        self._hashes = hashes
        for table, h in zip(self._tables, hashes):
            ends = table.get(h)
            if ends is None:
                table[h] = array("q", (pos,))
            else:
                ends.append(pos)

    def anchors(self, max_anchors: int) -> list[tuple[int, list[int]]]:
        """(length m, earlier end positions) for suffixes seen before, longest first.

        Shorter suffixes are listed only when they add occurrences (a suffix occurring exactly
        where a longer one does has the same continuations). At most `max_occurrences` most
        recent positions are kept per length.
        """
        out: list[tuple[int, list[int]]] = []
        last_count = 0
        for m in range(len(self._hashes), 0, -1):
            ends = self._tables[m - 1].get(self._hashes[m - 1])
            count = 0 if ends is None else len(ends) - 1  # the last entry is the suffix itself
            if count > last_count:
                out.append((m, ends[max(0, count - self.max_occurrences) : count].tolist()))
                last_count = count
                if len(out) == max_anchors or count >= self.max_occurrences:
                    break
        return out

    def anchors_at(self, end: int, max_anchors: int) -> list[tuple[int, list[int]]]:
        """`anchors` of the suffix ending at position `end` instead of at the last token, by
        brute force: each earlier position's longest common suffix with it."""
        tokens = self.tokens
        if end < 0:
            return []
        longest = []
        for j in range(end):
            m = 0
            while (m < self.max_match and m <= j and tokens[j - m] == tokens[end - m]
                   and tokens[j - m] != SEPARATOR):
                m += 1
            longest.append(m)
        out: list[tuple[int, list[int]]] = []
        last_count = 0
        for m in range(self.max_match, 0, -1):
            ends = [j for j in range(end) if longest[j] >= m]
            if len(ends) > last_count:
                out.append((m, ends[-self.max_occurrences:]))
                last_count = len(ends)
                if len(out) == max_anchors or last_count >= self.max_occurrences:
                    break
        return out

    def continuations(self, ends: list[int], offset: int) -> dict[int, list[int]]:
        """Group occurrences by the token `offset + 1` after their end: token -> end positions."""
        tokens = self.tokens
        n = len(tokens)
        groups: dict[int, list[int]] = {}
        for end in ends:
            at = end + offset + 1
            if at < n:
                token = tokens[at]
                if token != SEPARATOR:
                    group = groups.get(token)
                    if group is None:
                        groups[token] = [end]
                    else:
                        group.append(end)
        return groups
