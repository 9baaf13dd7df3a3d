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

The kernels are SuffixAutomaton.transition and the streaming match (SuffixAutomaton.advance, fed
token by token, which equals match_state) on these tables, with the same results (the lockstep
tests compare the drafters tree for tree; tests/test_drafting_sam.py the walks).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.index.sam import ROOT, SEPARATOR, SuffixAutomaton
from ngramspec.drafting.kernels import hashtab as ht

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
def anchor_state(states, root, state) -> int:
    """The first state from `state` up its suffix links that has a continuation, or `root`
    (a match's corpus anchors are these states, longest match first: build.py's root cursors,
    and step.py's prefetch of what those read)."""
    while state > root and states[state + 1, S_EDGE] <= states[state, S_EDGE]:
        state = states[state, S_LINK]
    return max(root, state)


# ---- a batch's matches caught up, their walks interleaved ---------------------------------------
# Feeding a match its new tokens (SuffixAutomaton.advance per token; a match marked -1 starts over
# from the request's last `cap` tokens, which gives match_state's result) follows one chain of
# dependent reads per token (a state's row, the binary search of its edges, the target's row;
# suffix links on a mismatch), and in a corpus of millions of states nearly each is a cache miss,
# a large share of a request-step at many in flight. The walks of different requests are independent, so `step_lane` splits one walk
# at every read that would miss: it issues a prefetch for that read and returns, and the caller
# (kernels/step.py `_catch_up_batch`, before the builds, which read the matches) moves on to the
# other requests' walks before coming back. Each walk makes advance's reads in advance's order,
# so the matches are advance's (tests/test_drafting_sam.py checks them against the automaton).
#
# A lane is one (request, corpus) walk, an int64 row:
L_STATE, L_LEN, L_NEXT, L_END, L_STAGE, L_LINK, L_SLOT, L_CORPUS = range(8)
LANE_COLUMNS = 8
# Its stage: the next read that `step_lane` makes (each was prefetched when the stage was set).
FEED, SEARCH, LINKED, CLAMP_ROW, CLAMP_LINK = range(5)


@njit(cache=True, inline="always")
def start_lane(roots, k, match, lo, n, cap, lane) -> bool:
    """Set up the walk of `match` (row k of a request's matches) over tok[fed:n], from the
    root over the last `cap` tokens from `lo` on when the match is marked -1; False when there
    is nothing to feed (the match is then up to date)."""
    fed = match[M_FED]
    state, length = match[M_STATE], match[M_LEN]
    if fed < 0:
        state, length, fed = roots[k], 0, max(lo, n - cap)
    if fed >= n:
        match[M_STATE], match[M_LEN], match[M_FED] = state, length, n
        return False
    lane[L_STATE], lane[L_LEN], lane[L_NEXT], lane[L_END] = state, length, fed, n
    lane[L_STAGE], lane[L_CORPUS] = FEED, k
    return True


@njit(cache=True, inline="always")
def finish_lane(lane, match) -> None:
    match[M_STATE], match[M_LEN], match[M_FED] = lane[L_STATE], lane[L_LEN], lane[L_END]


@njit(cache=True, inline="always")
def _token_fed(lane) -> bool:
    lane[L_NEXT] += 1
    lane[L_STAGE] = FEED
    return lane[L_NEXT] == lane[L_END]


@njit(cache=True, inline="always")
def step_lane(states, trans, root, lane, tok, cap) -> bool:
    """One stage of `advance` on the lane's next token (see above); True once the lane fed its
    last token. `prefetch` is a hint: the reads are the same with or without it."""
    stage, state = lane[L_STAGE], lane[L_STATE]
    if stage == LINKED:  # advance's `length = states[state, S_LEN]` after a suffix link
        lane[L_LEN] = states[state, S_LEN]
        stage = FEED
    if stage == FEED:
        if tok[lane[L_NEXT]] == SEPARATOR:
            lane[L_STATE], lane[L_LEN] = root, 0
            return _token_fed(lane)
        ht.prefetch(trans, (states[state, S_EDGE] + states[state + 1, S_EDGE]) >> 1)
        lane[L_STAGE] = SEARCH
        return False
    if stage == SEARCH:
        nxt = transition(states, trans, state, tok[lane[L_NEXT]])
        if nxt >= 0:
            lane[L_STATE], lane[L_LEN] = nxt, lane[L_LEN] + 1
            ht.prefetch(states, nxt)
            ht.prefetch(states, nxt + 1)  # its edge range ends in the next row
            if lane[L_LEN] > cap:
                lane[L_STAGE] = CLAMP_ROW
                return False
            return _token_fed(lane)
        if state == root:
            lane[L_LEN] = 0
            return _token_fed(lane)
        link = states[state, S_LINK]
        lane[L_STATE] = link
        ht.prefetch(states, link)
        ht.prefetch(states, link + 1)
        lane[L_STAGE] = LINKED
        return False
    if stage == CLAMP_ROW:  # advance's clamp: read the state's link, then the link's length
        link = states[state, S_LINK]
        lane[L_LINK] = link
        ht.prefetch(states, link)
        lane[L_STAGE] = CLAMP_LINK
        return False
    link = lane[L_LINK]  # CLAMP_LINK
    if states[link, S_LEN] >= cap:
        lane[L_STATE] = link
        lane[L_LINK] = states[link, S_LINK]
        ht.prefetch(states, lane[L_LINK])
        return False
    lane[L_LEN] = cap
    return _token_fed(lane)
