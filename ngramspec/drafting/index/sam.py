"""Suffix automaton over int tokens: the index behind external corpora.

Online construction (`extend`) keeps Python dict transitions; `finalize()` propagates occurrence
counts and latest end positions along suffix links and freezes everything into flat numpy
arrays (CSR), so a finalized automaton is compact, read-only and reloads fast (`from_arrays`).

Documents are joined with `SEPARATOR`. Transitions on it are dropped at finalize, so no match
and no draft can ever cross a document boundary.

State semantics (standard): a state is a set of substrings sharing one end-position set;
`max_len(s)` is the longest of them; `occ(s)` is how often they occur; following a transition
on token t from the state of string w lands in the state of w+t, so the child's `occ` is the
number of occurrences of the continuation w+t.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

SEPARATOR = -(2**31)
ROOT = 0

_FORMAT_VERSION = 1


class SuffixAutomaton:
    def __init__(self) -> None:
        self._num_tokens = 0
        self._num_real_tokens = 0  # tokens other than SEPARATOR
        # Construction state (dropped at finalize).
        self._link: list[int] = [-1]
        self._len: list[int] = [0]
        self._next: list[dict[int, int]] = [{}]
        self._end: list[int] = [-1]  # end position for primary states, -1 for clones
        self._last = ROOT
        self._arrays: dict[str, np.ndarray] | None = None
        self._root_next: dict[int, int] = {}

    # ----------------------------------------------------------------- construction

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (use `SEPARATOR` between documents)."""
        if self._arrays is not None:
            raise RuntimeError("the suffix automaton is finalized; build a new one to add tokens")
        for token in tokens:
            self._extend_one(int(token))

    def add_document(self, tokens: Iterable[int]) -> None:
        """Append one document, preceded by a separator unless it is the first."""
        if self._num_tokens:
            self.extend([SEPARATOR])
        self.extend(tokens)

    def _extend_one(self, token: int) -> None:
        link, length, nxt = self._link, self._len, self._next
        cur = len(length)
        length.append(length[self._last] + 1)
        link.append(-1)
        nxt.append({})
        self._end.append(self._num_tokens)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = ROOT
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                nxt.append(dict(nxt[q]))
                self._end.append(-1)
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur
        self._num_tokens += 1
        if token != SEPARATOR:
            self._num_real_tokens += 1

    def finalize(self) -> None:
        """Propagate counts and recency, build sorted child lists, freeze into arrays."""
        if self._arrays is not None:
            return
        if self._num_real_tokens == 0:
            raise ValueError("External corpus is empty")
        occ, max_end = self._propagate()
        src, tok, dst = self._flatten_transitions()
        occ_arr = np.asarray(occ, dtype=np.int64)
        end_arr = np.asarray(max_end, dtype=np.int64)
        num_states = len(occ)
        arrays = {
            "link": np.asarray(self._link, dtype=np.int32),
            "max_len": np.asarray(self._len, dtype=np.int32),
            "occ": occ_arr,
            "max_end_pos": end_arr,
        }
        # Three CSR views of the same edges: by token (lookup), by frequency, by recency.
        by_tok = np.lexsort((tok, src))
        by_freq = np.lexsort((dst, tok, -occ_arr[dst], src))
        by_rec = np.lexsort((dst, tok, -end_arr[dst], src))
        arrays["offsets"] = np.searchsorted(src[by_tok], np.arange(num_states + 1)).astype(np.int64)
        for name, order in (("tok", by_tok), ("freq", by_freq), ("rec", by_rec)):
            arrays[f"{name}_token"] = tok[order].astype(np.int32)
            arrays[f"{name}_state"] = dst[order].astype(np.int32)
        self._install(arrays, self._num_tokens)

    def _propagate(self) -> tuple[list[int], list[int]]:
        occ = [1 if e >= 0 else 0 for e in self._end]
        occ[ROOT] = 0
        max_end = list(self._end)
        link = self._link
        # Longer states first: every suffix link points to a strictly shorter state.
        order = np.argsort(-np.asarray(self._len, dtype=np.int64), kind="stable").tolist()
        for s in order:
            p = link[s]
            if p >= 0:
                occ[p] += occ[s]
                max_end[p] = max(max_end[p], max_end[s])
        return occ, max_end

    def _flatten_transitions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src: list[int] = []
        tok: list[int] = []
        dst: list[int] = []
        for s, edges in enumerate(self._next):
            for t, d in edges.items():
                if t != SEPARATOR:
                    src.append(s)
                    tok.append(t)
                    dst.append(d)
        return (
            np.asarray(src, dtype=np.int64),
            np.asarray(tok, dtype=np.int64),
            np.asarray(dst, dtype=np.int64),
        )

    def _install(self, arrays: dict[str, np.ndarray], num_tokens: int) -> None:
        self._arrays = arrays
        self._num_tokens = num_tokens
        self._link, self._len, self._next, self._end = [], [], [], []
        # Hot read paths use Python lists: numpy scalar indexing is ~10x slower per access.
        self._link_l: list[int] = arrays["link"].tolist()
        self._len_l: list[int] = arrays["max_len"].tolist()
        self._occ_l: list[int] = arrays["occ"].tolist()
        self._off_l: list[int] = arrays["offsets"].tolist()
        lo, hi = self._off_l[ROOT], self._off_l[ROOT + 1]
        self._root_next = dict(
            zip(arrays["tok_token"][lo:hi].tolist(), arrays["tok_state"][lo:hi].tolist())
        )

    # ----------------------------------------------------------------- read access

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far, separators included (SGLang's tokenCount)."""
        return self._num_tokens

    @property
    def num_states(self) -> int:
        return len(self._len_l) if self._arrays is not None else len(self._len)

    @property
    def is_finalized(self) -> bool:
        return self._arrays is not None

    def _frozen(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            raise RuntimeError("call finalize() first")
        return self._arrays

    def occ(self, state: int) -> int:
        self._frozen()
        return self._occ_l[state]

    def max_len(self, state: int) -> int:
        self._frozen()
        return self._len_l[state]

    def link(self, state: int) -> int:
        self._frozen()
        return self._link_l[state]

    def max_end_pos(self, state: int) -> int:
        return int(self._frozen()["max_end_pos"][state])

    def transition(self, state: int, token: int) -> int:
        """The state reached from `state` on `token`, or -1 (never on SEPARATOR)."""
        arrays = self._frozen()
        if state == ROOT:
            return self._root_next.get(token, -1)
        lo, hi = self._off_l[state], self._off_l[state + 1]
        if lo == hi:
            return -1
        toks = arrays["tok_token"]
        i = lo + int(np.searchsorted(toks[lo:hi], token))
        if i < hi and toks[i] == token:
            return int(arrays["tok_state"][i])
        return -1

    def num_children(self, state: int) -> int:
        self._frozen()
        return self._off_l[state + 1] - self._off_l[state]

    def children_by_freq(self, state: int, limit: int | None = None) -> list[tuple[int, int, int]]:
        """(token, child_state, occurrences) sorted by (occurrences desc, token asc)."""
        arrays = self._frozen()
        lo, hi = self._off_l[state], self._off_l[state + 1]
        if limit is not None:
            hi = min(hi, lo + limit)
        kids = arrays["freq_state"][lo:hi]
        return list(zip(arrays["freq_token"][lo:hi].tolist(), kids.tolist(),
                        arrays["occ"][kids].tolist()))

    def children_by_recency(
        self, state: int, limit: int | None = None
    ) -> list[tuple[int, int, int]]:
        """(token, child_state, latest end position) sorted by (position desc, token asc)."""
        arrays = self._frozen()
        lo, hi = self._off_l[state], self._off_l[state + 1]
        if limit is not None:
            hi = min(hi, lo + limit)
        kids = arrays["rec_state"][lo:hi]
        return list(zip(arrays["rec_token"][lo:hi].tolist(), kids.tolist(),
                        arrays["max_end_pos"][kids].tolist()))

    # ----------------------------------------------------------------- matching

    def advance(self, state: int, length: int, token: int, max_len: int) -> tuple[int, int]:
        """Streaming longest-suffix match: (state, length) after appending `token`.

        The result is the longest suffix of (matched text + token) of length <= max_len that
        occurs in the corpus, so feeding a context token by token equals `match_state`.
        """
        if token == SEPARATOR:
            return ROOT, 0
        link, lens = self._link_l, self._len_l
        while True:
            nxt = self.transition(state, token)
            if nxt >= 0:
                state, length = nxt, length + 1
                break
            if state == ROOT:
                return ROOT, 0
            state = link[state]
            length = lens[state]
        if length > max_len:
            # Clamp: move to the state that holds the length-max_len suffix.
            while lens[link[state]] >= max_len:
                state = link[state]
            length = max_len
        return state, length

    def match_state(self, context: list[int], max_len: int) -> tuple[int, int]:
        """(state, length) of the longest suffix of context[-max_len:] found in the corpus."""
        self._frozen()
        state, length = ROOT, 0
        for token in context[max(0, len(context) - max_len):]:
            state, length = self.advance(state, length, token, max_len)
        return state, length

    def anchors(self, state: int, length: int) -> list[tuple[int, int]]:
        """Suffix-link climb from a match: (state, matched_len) with >= 1 child, longest first."""
        self._frozen()
        out = []
        link, lens, off = self._link_l, self._len_l, self._off_l
        while state > ROOT:
            if off[state + 1] > off[state]:
                out.append((state, min(length, lens[state])))
            state = link[state]
        return out

    def match(self, context: list[int], max_len: int) -> list[tuple[int, int]]:
        """Longest-suffix walk over the last max_len tokens, then link climb
        (docs/reference/sglang_ngram.md §2.5)."""
        return self.anchors(*self.match_state(context, max_len))

    # ----------------------------------------------------------------- persistence

    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = self._frozen()
        meta = {"format": "ngramspec.sam", "version": _FORMAT_VERSION,
                "num_tokens": self._num_tokens, "num_states": self.num_states}
        return meta, dict(arrays)

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> SuffixAutomaton:
        if meta.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unsupported suffix automaton version {meta.get('version')!r}")
        missing = sorted(set(_ARRAY_NAMES) - set(arrays))
        if missing:
            raise ValueError(f"suffix automaton arrays missing: {missing}")
        sam = cls()
        sam._install({name: np.asarray(arrays[name]) for name in _ARRAY_NAMES},
                     int(meta["num_tokens"]))
        if len(sam._len_l) != int(meta["num_states"]):
            raise ValueError("suffix automaton arrays do not match meta['num_states']")
        return sam


_ARRAY_NAMES = (
    "link", "max_len", "occ", "max_end_pos", "offsets",
    "tok_token", "tok_state", "freq_token", "freq_state", "rec_token", "rec_state",
)
