"""The layout of the arrays the native drafter kernels (drafter.cpp) read and write.

The Python side makes every array (numpy, grown and replaced here and in drafting/index/) and
hands it to the native `Drafter` object, which holds it while it reads it (drafting/drafter.py).
The column numbers below are drafter.cpp's; `check_layout` compares them with the loaded
module's once.
"""

from __future__ import annotations

import numpy as np

from ngramspec.drafting.calibration import GAIN_FLOATS, NUM_BUCKETS, NUM_CLASSES
from ngramspec.drafting.index.sam import ROOT as SAM_ROOT
from ngramspec.drafting.index.sam import SuffixAutomaton

SEPARATOR = -(2**31)

# ---- the global trie: node columns (int32) and meta (int64)
TOK, PAR, CNT, FIRST, NEXT, PREV, LPREV, LNEXT, VER = range(9)
TRIE_COLS = 9
T_NUM, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH, STAMP, LINKED = range(8)
TRIE_ROOT = 0

# ---- a request's context index: st (int64) columns; the hash of a window
C_NUM, NUM_HASHES, ENTRIES, SUFFIX_COUNTS = range(4)
HASH_BASE = 0x100000001B3  # odd, so multiplication is a bijection mod 2**64

# ---- the corpus bank's columns
S_LINK, S_LEN, S_OCC, S_EDGE = range(4)
T_TOKEN, T_TARGET = range(2)
E_TOKEN, E_OCC, E_LO, E_HI = range(4)
M_STATE, M_LEN, M_FED = range(3)  # a request's match in one corpus

# ---- the tree build: scratch columns, parameters, a request's int header
CURSOR_COLUMNS = 8
CAND_COLUMNS = 5
# params (read-only in a build, so builds may run in parallel): top-k children per cursor,
# anchors per source, occurrences per context match, then the config's fixed sizes (scratch
# cursors, pool, group columns; tree nodes and evidence slots of a request), the context's
# longest match, whether to calibrate, the corpora's longest match, the most wildcards and
# whether to fall back on the trie's root (config.py: max_wildcards, trie_fallback).
(P_LIMIT, P_ANCHORS, P_OCC, P_CURSORS, P_POOL, P_GROUPS, P_NODES, P_EVIDENCE, P_MAX_MATCH,
 P_CALIBRATE, P_SAM_MATCH, P_WILDCARDS, P_TRIE_FALLBACK) = range(13)
NUM_PARAMS = 13
# A request's int buffer starts with: where its tokens begin in its context array, the nodes of
# its last tree still awaiting commit (0: none), and its evidence slots (the corpora in use when
# its buffers were laid out size them, so a commit reads a pending tree with its build's layout).
R_TRIE_START, R_PENDING, R_EVIDENCE, R_HEAD = range(4)

# ---- one call per step: the queue's operations and the failure codes
O_SLOT, O_COUNT, O_TRIE_FROM, O_TOKENS = range(4)  # a queued operation's header, then its tokens
BAD_TOKENS = -3  # a queued token is not an int32 (nothing ran); -2: the trie was not grown first
BAD_SLOT = -4  # the queue or batch names a slot without arrays, or laid out for other corpora

_CHECKED = {"TRIE_COLS": TRIE_COLS, "CURSOR_COLUMNS": CURSOR_COLUMNS,
            "CAND_COLUMNS": CAND_COLUMNS, "NUM_PARAMS": NUM_PARAMS, "R_HEAD": R_HEAD,
            "O_TOKENS": O_TOKENS, "BAD_TOKENS": BAD_TOKENS, "BAD_SLOT": BAD_SLOT, "NUM_CLASSES": NUM_CLASSES, "NUM_BUCKETS": NUM_BUCKETS,
            "GAIN_FLOATS": GAIN_FLOATS, "SUFFIX_COUNTS": SUFFIX_COUNTS, "LINKED": LINKED,
            "STAMP": STAMP}


def check_layout(native_layout: dict) -> None:
    """The loaded module was built with these column numbers (a stale build would not be)."""
    wrong = {k: (v, native_layout.get(k)) for k, v in _CHECKED.items()
             if native_layout.get(k) != v}
    if wrong:
        raise RuntimeError(f"drafter.cpp and kernels/layout.py disagree on {wrong}")


def table_size(entries: int) -> int:
    """A power of two keeping a hash table's load factor at or below 3/4."""
    size = 1024
    while size * 3 < entries * 4:
        size *= 2
    return size


class Scratch:
    """The kernels' work arrays, sized for the worst case of a config, one row per build thread
    (rows a cache line apart at least: each thread writes its own row):
      ints, floats  a build's cursors, candidates, ranking, pool and groups (drafter.cpp
                    BuildScratch);
      work          the trie levels of a commit, a tree's accepted flags, a build's root
                    anchors; row 0 serves the queue;
      counts        the drafts each thread placed by source (summed after the builds).
    """

    def __init__(self, budget: int, limit: int, anchors: int, occurrences: int,
                 num_corpora: int, depth: int, sources: int, threads: int = 1) -> None:
        root = root_cursors(anchors, num_corpora)
        self.cursors = root * (1 + (budget + 1) * limit) + 16
        self.pool = anchors * occurrences * (budget + 2) + 16
        self.groups = occurrences + 1
        ints = (CURSOR_COLUMNS + CAND_COLUMNS + 1) * self.cursors + self.pool \
            + 5 * self.groups + 4
        self.ints = np.zeros((threads, padded(ints)), np.int64)
        self.floats = np.zeros((threads, padded(4 * self.cursors)), np.float64)
        work = max(2 * depth, budget + 1, 3 * anchors)
        self.work = np.zeros((threads, padded(work)), np.int64)
        self.counts = np.zeros((threads, padded(sources)), np.int64)


def padded(columns: int) -> int:
    """8-byte columns rounded up to whole 64-byte lines plus one spare line, so rows of an
    array that does not start on a line boundary still never share one."""
    return -(-columns // 8) * 8 + 8


def root_cursors(anchors: int, num_corpora: int) -> int:
    """An upper bound on a tree's root cursors: `anchors` per source and per corpus, and the
    trie fallback."""
    return (2 + num_corpora) * anchors + 2


def tree_sizes(budget: int, anchors: int, num_corpora: int) -> tuple[int, int]:
    """(nodes, evidence slots) of one tree: each node has at most one cursor per root anchor."""
    nodes = budget + 1
    return nodes, nodes * root_cursors(anchors, num_corpora)


def request_sizes(budget: int, anchors: int, num_corpora: int) -> tuple[int, int]:
    """(int, float) buffer lengths of one request's tree, evidence and gain (drafter.cpp
    RequestTree); the gain sums are the floats' last GAIN_FLOATS."""
    nodes, evidence = tree_sizes(budget, anchors, num_corpora)
    return R_HEAD + 3 * nodes + 2 * evidence + nodes + 1, 2 * nodes + evidence + GAIN_FLOATS


class CorpusBank:
    """Every corpus of one snapshot (sorted by name, the order the drafter's cursors follow)
    re-laid end to end into three int32 tables, so one kernel call reads them all and each visit
    to a state or an edge costs one cache line:
      states [S + 1, 4]: link, max_len, occ, first edge (row s + 1's first edge ends state s's
                         range; the last row is a sentinel);
      trans  [E, 2]:     token, target, sorted by token within each state (transitions);
      edges  [E, 4]:     token, occ(target), target's first edge, target's edge end, sorted by
                         frequency within each state (what a cursor expands).
    Corpus k's states are `roots[k] .. roots[k + 1] - 1`. The tables cost 24 B per edge plus
    16 B per state, built once per snapshot change."""

    def __init__(self, sams: list[SuffixAutomaton]) -> None:
        parts = [sam.to_arrays()[1] for sam in sams]
        self.num_corpora = len(parts)
        sizes = [len(p["max_len"]) for p in parts]
        edge_sizes = [int(p["offsets"][-1]) for p in parts]
        if sum(sizes) >= 2**31 or sum(edge_sizes) >= 2**31:
            raise ValueError("external corpora hold more than 2**31 automaton states or edges")
        bases = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        edge_bases = np.cumsum([0] + edge_sizes[:-1]).astype(np.int64)
        self.roots = bases + SAM_ROOT
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


class NoBank:
    """The corpus tables of no corpus."""

    states = np.zeros((1, 4), np.int32)  # the sentinel row only
    trans = np.zeros((0, 2), np.int32)
    edges = np.zeros((0, 4), np.int32)
    roots = np.zeros(0, np.int64)
