"""numba kernels over the external corpora's suffix automata, and the bank they read.

`CorpusBank` re-lays every corpus of one snapshot (sorted by name, the order the drafter's cursors
follow) end to end into three int32 tables, so one kernel call reads them all and each visit to a
state or an edge costs one cache line (a corpus of millions of states does not fit in cache; with
the automata's separate arrays every child cost a miss in occ and another in offsets):
  states [S + 1, 4]: link, max_len, occ, first edge (row s + 1's first edge ends state s's range;
                     the last row is a sentinel);
  trans  [E, 2]:     token, target, sorted by token within each state (transitions);
  edges  [E, 4]:     token, occ(target), target's first edge, target's edge end, sorted by
                     frequency within each state (what a cursor expands).
Corpus k's states are `roots[k] .. roots[k + 1] - 1` and its links and edges stay in that range.
The tables cost 24 B per edge plus 16 B per state (90 MB for the 1.2M-token standard-library
corpus, whose automaton arrays are 117 MB); they are built once per snapshot change.

The kernels are SuffixAutomaton.transition / advance / match_state on these tables, with the same
results (the lockstep tests compare the drafters tree for tree).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.index.sam import ROOT, SEPARATOR, SuffixAutomaton

S_LINK, S_LEN, S_OCC, S_EDGE = range(4)  # columns of CorpusBank.states
T_TOKEN, T_TARGET = range(2)  # columns of CorpusBank.trans
E_TOKEN, E_OCC, E_LO, E_HI = range(4)  # columns of CorpusBank.edges
# A request's match in corpus k is match[k] = (state, matched length, tokens fed so far), the
# last an index into the request's context array; -1 there means "match from scratch".
M_STATE, M_LEN, M_FED = range(3)


class CorpusBank:
    """The tables of several finalized automata as one (see the module docstring)."""

    def __init__(self, sams: list[SuffixAutomaton]) -> None:
        parts = [sam.to_arrays()[1] for sam in sams]
        self.num_corpora = len(parts)
        sizes = [len(p["max_len"]) for p in parts]
        edge_sizes = [int(p["offsets"][-1]) for p in parts]
        if sum(sizes) >= 2**31 or sum(edge_sizes) >= 2**31:
            raise ValueError("external corpora hold more than 2**31 automaton states or edges")
        bases = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        edge_bases = np.cumsum([0] + edge_sizes[:-1]).astype(np.int64)
        self.roots = bases + ROOT
        self.states = np.empty((sum(sizes) + 1, 4), np.int32)
        self.trans = np.empty((sum(edge_sizes), 2), np.int32)
        self.edges = np.empty((sum(edge_sizes), 4), np.int32)
        for p, base, edge_base in zip(parts, bases, edge_bases):
            self._add(p, int(base), int(edge_base))
        self.states[-1] = (-1, 0, 0, sum(edge_sizes))

    def _add(self, p: dict[str, np.ndarray], base: int, edge_base: int) -> None:
        num, num_edges = len(p["max_len"]), int(p["offsets"][-1])
        states = self.states[base:base + num]
        states[:, S_LINK] = np.where(p["link"] >= 0, p["link"] + base, -1)
        states[:, S_LEN] = p["max_len"]
        states[:, S_OCC] = p["occ"]  # occ <= tokens < states < 2**31
        states[:, S_EDGE] = p["offsets"][:-1] + edge_base
        trans = self.trans[edge_base:edge_base + num_edges]
        trans[:, T_TOKEN], trans[:, T_TARGET] = p["tok_token"], p["tok_state"] + base
        target = p["freq_state"]
        edges = self.edges[edge_base:edge_base + num_edges]
        edges[:, E_TOKEN], edges[:, E_OCC] = p["freq_token"], p["occ"][target]
        edges[:, E_LO] = p["offsets"][target] + edge_base
        edges[:, E_HI] = p["offsets"][target + 1] + edge_base

    def new_matches(self) -> np.ndarray:
        """A request's match rows (int64 [num_corpora, 3]), all to be matched from scratch."""
        match = np.zeros((self.num_corpora, 3), np.int64)
        match[:, M_STATE], match[:, M_FED] = self.roots, -1
        return match


@njit(cache=True, inline="always")
def transition(states, trans, state, token) -> int:
    """The state reached from `state` on `token`, or -1 (binary search of the sorted edges)."""
    lo, hi = states[state, S_EDGE], states[state + 1, S_EDGE]
    end = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if trans[mid, T_TOKEN] < token:
            lo = mid + 1
        else:
            hi = mid
    if lo < end and trans[lo, T_TOKEN] == token:
        return trans[lo, T_TARGET]
    return -1


@njit(cache=True, inline="always")
def advance(states, trans, root, state, length, token, cap) -> tuple:
    """SuffixAutomaton.advance: (state, length) of the longest suffix <= cap after `token`."""
    if token == SEPARATOR:
        return root, 0
    while True:
        nxt = transition(states, trans, state, token)
        if nxt >= 0:
            state, length = nxt, length + 1
            break
        if state == root:
            return root, 0
        state = states[state, S_LINK]
        length = states[state, S_LEN]
    if length > cap:
        # Clamp: move to the state that holds the length-cap suffix.
        while states[states[state, S_LINK], S_LEN] >= cap:
            state = states[state, S_LINK]
        length = cap
    return state, length


@njit(cache=True, inline="always")
def catch_up(states, trans, roots, match, tok, lo, n, cap) -> None:
    """Feed every corpus's match the context tokens it has not seen (tok[lo:n] are the
    request's own tokens); a row marked -1 starts over from the last `cap` of them, which gives
    the same match (SuffixAutomaton.match_state)."""
    for k in range(roots.shape[0]):
        fed = match[k, M_FED]
        if fed < 0:
            match[k, M_STATE], match[k, M_LEN], fed = roots[k], 0, max(lo, n - cap)
        state, length = match[k, M_STATE], match[k, M_LEN]
        for i in range(fed, n):
            state, length = advance(states, trans, roots[k], state, length, tok[i], cap)
        match[k, M_STATE], match[k, M_LEN], match[k, M_FED] = state, length, n
