"""numba kernel of the drafter's best-first tree build over every source.

The tree walk (tests/oracles/drafter.py is its slow reference): the context's anchors, then the
trie's distinct-count anchors, then each external corpus's suffix-link anchors (corpora sorted by
name) become root cursors; each expansion merges its cursors' continuations by token (first-seen
order, the higher estimate wins) and ranks one candidate per token by (-path probability, push
sequence), keeping only the best the tree can still take (`_rank`); the best is placed next, and
every placed node keeps its evidence (source, matched length, raw estimate) for calibration.
Cursors and candidates live in preallocated scratch (`Scratch`):
  cursor columns: SRC, A (trie node | pool start | automaton state's first edge),
                  B (pool length | the state's occurrences), OFF (context offset | the
                  state's edge end), LEN (matched length), NEXT (next cursor of the same
                  candidate), CLS (the evidence class that proposed it: calibration.py), WILD
                  (1: a wildcard match or a fallback, and all that descends from it)
  candidate columns: SLOT (parent node), TOK, SRC, HEAD, TAIL (its cursor list)
Context cursors keep their end positions as segments of `pool`. kernels/step.py calls `build` for
every request of a batch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.calibration import (
    BUCKET_EDGES,
    GAIN_ACCEPTED,
    GAIN_FLOATS,
    GAIN_PREDICTED,
    GAIN_PRIOR,
    MAX_CONDITIONAL,
    SKIP_CLASSES,
)
from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.kernels import context as cx
from ngramspec.drafting.kernels import hashtab as ht
from ngramspec.drafting.kernels import sam as sk
from ngramspec.drafting.kernels import trie as tk
from ngramspec.drafting.sources import CONTEXT, CORPUS, TRIE

C_SRC, C_A, C_B, C_OFF, C_LEN, C_NEXT, C_CLS, C_WILD = range(8)
CURSOR_COLUMNS = 8
WALK_LANES = 32  # corpus walks in flight at once (Scratch.lanes): a core tracks ~20-odd misses
K_SLOT, K_TOK, K_SRC, K_HEAD, K_TAIL = range(5)
# params (read-only in a build, so builds may run in parallel): top-k children per cursor,
# anchors per source, occurrences per context match, then the config's fixed sizes (scratch
# cursors, pool, group columns; tree nodes and evidence slots of a request), the context's
# longest match, whether to calibrate, the corpora's longest match, the most wildcards and
# whether to fall back on the trie's root (config.py: max_wildcards, trie_fallback).
(P_LIMIT, P_ANCHORS, P_OCC, P_CURSORS, P_POOL, P_GROUPS, P_NODES, P_EVIDENCE, P_MAX_MATCH,
 P_CALIBRATE, P_SAM_MATCH, P_WILDCARDS, P_TRIE_FALLBACK) = range(13)
# counts (int64): next cursor, next candidate, ranked candidates, pool used
N_CUR, N_CAND, N_RANKED, N_POOL = range(4)
# A request's int buffer starts with: where its tokens begin in its context array, the number of
# nodes of its last kernel-built tree still awaiting commit (0: none), and its evidence slots (the
# corpora in use when its buffers were laid out size them, so a commit reads a pending tree with
# the layout it was built under).
R_TRIE_START, R_PENDING, R_EVIDENCE, R_HEAD = 0, 1, 2, 3
BUCKETS = np.asarray(BUCKET_EDGES, np.int64)
assert (CONTEXT, TRIE, CORPUS) == (0, 1, 2), "request_gains indexes its tuple by source id"


class Scratch:
    """The kernels' work arrays, sized for the worst case of a config, one row per build thread
    (rows a cache line apart at least: each thread writes its own row):
      ints, floats  a build's cursors, candidates, ranking, pool and groups (`_scratch_views`), in
                    one buffer per dtype because numba's dispatch costs about 0.1 µs per argument,
                    a tenth of a whole request-step with one argument per array;
      work          the trie levels of a commit, a tree's accepted flags, a build's root anchors
                    (allocating them inside a kernel cost a malloc and two atomic reference
                    counts, more than the work); row 0 serves the queue;
      counts        the drafts each thread placed by source (summed after the builds);
      lanes         the corpus walks in flight before the builds (kernels/sam.py; step.py runs
                    at most this many at once: enough for their misses to overlap).
    """

    def __init__(self, budget: int, limit: int, anchors: int, occurrences: int,
                 num_corpora: int, depth: int, sources: int, threads: int = 1) -> None:
        root = root_cursors(anchors, num_corpora)
        self.cursors = root * (1 + (budget + 1) * limit) + 16
        self.pool = anchors * occurrences * (budget + 2) + 16
        self.groups = occurrences + 1
        ints = (CURSOR_COLUMNS + 6) * self.cursors + self.pool + 5 * self.groups + 4
        self.ints = np.zeros((threads, padded(ints)), np.int64)
        self.floats = np.zeros((threads, padded(4 * self.cursors)), np.float64)
        work = max(2 * depth, budget + 1, 3 * anchors)
        self.work = np.zeros((threads, padded(work)), np.int64)
        self.counts = np.zeros((threads, padded(sources)), np.int64)
        self.lanes = np.zeros((max(WALK_LANES, num_corpora), sk.LANE_COLUMNS), np.int64)


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
    """(int, float) buffer lengths of one request's tree, evidence and gain (`request_views`);
    the gain sums are the floats' last GAIN_FLOATS."""
    nodes, evidence = tree_sizes(budget, anchors, num_corpora)
    return R_HEAD + 3 * nodes + 2 * evidence + nodes + 1, 2 * nodes + evidence + GAIN_FLOATS


@njit(cache=True, inline="always")
def request_views(r_ints, r_floats, params):
    """out_i [3, nodes] (token, parent, source), ev_i [2, evidence] (class, matched length),
    ev_off [nodes + 1] (node i's evidence is ev_off[i]:ev_off[i + 1]), out_p [nodes] (path
    probabilities), ev_raw [evidence], out_base [nodes] (each node's conditional estimate
    before the request gain), gain [GAIN_FLOATS] (the request's acceptance sums per source:
    calibration.py)."""
    nodes, evidence = params[P_NODES], r_ints[R_EVIDENCE]
    o = R_HEAD
    out_i = r_ints[o:o + 3 * nodes].reshape((3, nodes))
    o += 3 * nodes
    ev_i = r_ints[o:o + 2 * evidence].reshape((2, evidence))
    o += 2 * evidence
    ev_off = r_ints[o:o + nodes + 1]
    o = nodes + evidence
    return (out_i, ev_i, ev_off, r_floats[:nodes], r_floats[nodes:o], r_floats[o:o + nodes],
            r_floats[o + nodes:o + nodes + GAIN_FLOATS])


@njit(cache=True, inline="always")
def _scratch_views(ints, floats, params):
    cursors, pool, groups = params[P_CURSORS], params[P_POOL], params[P_GROUPS]
    o = 0
    cur = ints[o:o + CURSOR_COLUMNS * cursors].reshape((CURSOR_COLUMNS, cursors))
    o += CURSOR_COLUMNS * cursors
    cand = ints[o:o + 5 * cursors].reshape((5, cursors))
    o += 5 * cursors
    ranked = ints[o:o + cursors]
    o += cursors
    pool_a = ints[o:o + pool]
    o += pool
    groups_a = ints[o:o + 5 * groups].reshape((5, groups))
    o += 5 * groups
    counts = ints[o:o + 4]
    raw = floats[:cursors]
    # estimate, -path probability, the estimate before the request gain
    cand_f = floats[cursors:4 * cursors].reshape((3, cursors))
    return cur, raw, cand, cand_f, ranked, pool_a, groups_a, counts


@njit(cache=True, inline="always")
def bucket(length: int) -> int:
    b = 0
    while b < BUCKETS.shape[0] and BUCKETS[b] <= length - 1:
        b += 1
    return b


@njit(cache=True, inline="always")
def _factor(factor: np.ndarray, calibrate: bool, cls: int, length: int) -> float:
    """The calibration factor of a cursor's continuations (one class and matched length)."""
    return factor[cls, bucket(length)] if calibrate else 1.0


@njit(cache=True, inline="always")
def _estimate(f: float, raw: float, gain: float) -> tuple:
    """(estimate, the estimate before the request gain): what ranks the node, and what its
    gain learns against (a capped estimate divided by the gain would not be it)."""
    p = raw * f
    return min(MAX_CONDITIONAL, p * gain), min(MAX_CONDITIONAL, p)


@njit(cache=True, inline="always")
def request_gain(gain: np.ndarray, settings: np.ndarray, src: int) -> float:
    """The request's recent acceptance of `src`'s drafts over their estimates (calibration.py);
    1 when off."""
    g = settings[GAIN_PRIOR]
    if g <= 0.0:
        return 1.0
    return (gain[2 * src + GAIN_ACCEPTED] + g) / (gain[2 * src + GAIN_PREDICTED] + g)


@njit(cache=True, inline="always")
def request_gains(gain: np.ndarray, settings: np.ndarray) -> tuple:
    """`request_gain` of each source, indexed by source id (asserted 0, 1, 2 below)."""
    return (request_gain(gain, settings, CONTEXT), request_gain(gain, settings, TRIE),
            request_gain(gain, settings, CORPUS))


@njit(cache=True, inline="always")
def _class(src: int, occurrences: int, wild: int) -> int:
    """The evidence class (calibration.py): 2 * source + (one earlier occurrence only), then
    SKIP_CLASSES further for a wildcard match or a fallback."""
    return 2 * src + (1 if occurrences <= 1 else 0) + (SKIP_CLASSES if wild else 0)


@njit(cache=True, inline="always")
def _ranks_before(cand_f: np.ndarray, a: int, b: int) -> bool:
    """Candidate a is placed before b: a higher path probability, then the earlier push."""
    pa, pb = cand_f[1, a], cand_f[1, b]
    return pa < pb or (pa == pb and a < b)


@njit(cache=True, inline="always")
def _rank(ranked: np.ndarray, counts: np.ndarray, cand_f: np.ndarray, c: int,
          room: int) -> None:
    """Insert candidate c into the ranked candidates (best first), keeping the best `room`:
    the tree takes at most `room` more nodes, each the best candidate left, and a later
    candidate never ranks above its parent, so one that ranks below `room` others is never
    placed."""
    size = counts[N_RANKED]
    if size >= room and not _ranks_before(cand_f, c, ranked[room - 1]):
        return
    i = min(size, room - 1)
    while i > 0 and _ranks_before(cand_f, c, ranked[i - 1]):
        ranked[i] = ranked[i - 1]
        i -= 1
    ranked[i] = c
    counts[N_RANKED] = min(size + 1, room)


@njit(cache=True, inline="always")
def _unrank(ranked: np.ndarray, counts: np.ndarray, c: int) -> None:
    """Take candidate c out of the ranking if it is in it (to rank it again, higher)."""
    size = counts[N_RANKED]
    for i in range(size):
        if ranked[i] == c:
            for j in range(i, size - 1):
                ranked[j] = ranked[j + 1]
            counts[N_RANKED] = size - 1
            return


@njit(cache=True, inline="always")
def _take_best(ranked: np.ndarray, counts: np.ndarray, room: int) -> int:
    """The best candidate, out of the ranking, which then keeps `room` (the nodes the tree can
    take after it) at most."""
    top = ranked[0]
    size = counts[N_RANKED] - 1
    for i in range(size):
        ranked[i] = ranked[i + 1]
    counts[N_RANKED] = min(size, room)
    return top


@njit(cache=True, inline="always")
def _threshold(ranked: np.ndarray, counts: np.ndarray, cand_f: np.ndarray, room: int) -> float:
    """The path probability a new candidate must beat to be placed: that of the room-th ranked
    candidate (it loses ties, being pushed later), or -1 while fewer are ranked."""
    return -cand_f[1, ranked[room - 1]] if counts[N_RANKED] >= room else -1.0


@njit(cache=True, inline="always")
def _new_cursor(cur: np.ndarray, counts: np.ndarray, src: int, a: int, b: int, off: int,
                length: int, cls: int, wild: int) -> int:
    c = counts[N_CUR]
    counts[N_CUR] = c + 1
    cur[C_SRC, c], cur[C_A, c], cur[C_B, c] = src, a, b
    cur[C_OFF, c], cur[C_LEN, c], cur[C_NEXT, c], cur[C_CLS, c] = off, length, -1, cls
    cur[C_WILD, c] = wild
    return c


@njit(cache=True, inline="always")
def _offer(s_cur, s_raw, s_cand, s_cand_f, ranked, counts, first_cand, slot, token, src, est,
           base, kid, raw, prob, room) -> None:
    """Merge a continuation into this expansion's candidates (ReferenceDrafter._push_children),
    ranking a new candidate, or one whose estimate rose, at once: the next cursor's threshold
    counts it."""
    s_raw[kid] = raw
    for k in range(first_cand, counts[N_CAND]):
        if s_cand[K_TOK, k] == token:
            s_cur[C_NEXT, s_cand[K_TAIL, k]] = kid
            s_cand[K_TAIL, k] = kid
            if est > s_cand_f[0, k]:
                s_cand_f[0, k], s_cand_f[1, k], s_cand_f[2, k] = est, -prob * est, base
                s_cand[K_SRC, k] = src
                _unrank(ranked, counts, k)
                _rank(ranked, counts, s_cand_f, k, room)
            return
    k = counts[N_CAND]
    counts[N_CAND] = k + 1
    s_cand[K_SLOT, k], s_cand[K_TOK, k], s_cand[K_SRC, k] = slot, token, src
    s_cand[K_HEAD, k], s_cand[K_TAIL, k] = kid, kid
    s_cand_f[0, k], s_cand_f[1, k], s_cand_f[2, k] = est, -prob * est, base
    _rank(ranked, counts, s_cand_f, k, room)


@njit(cache=True, inline="always")
def _context_groups(tok, n_tok, pool, start, num, off, groups) -> int:
    """Group the ends by the token `off + 1` after them; stable-sort groups by size desc."""
    g = 0
    for i in range(num):
        at = pool[start + i] + off + 1
        if at >= n_tok or tok[at] == SEPARATOR:
            groups[3, i] = -1
            continue
        t = tok[at]
        j = 0
        while j < g and groups[0, j] != t:
            j += 1
        if j == g:
            groups[0, g], groups[1, g], groups[2, g] = t, 0, g
            g += 1
        groups[1, j] += 1
        groups[3, i] = j
    for i in range(1, g):  # insertion sort: stable
        t, size, first = groups[0, i], groups[1, i], groups[2, i]
        j = i - 1
        while j >= 0 and groups[1, j] < size:
            groups[0, j + 1], groups[1, j + 1], groups[2, j + 1] = (
                groups[0, j], groups[1, j], groups[2, j])
            j -= 1
        groups[0, j + 1], groups[1, j + 1], groups[2, j + 1] = t, size, first
    return g


@njit(cache=True, inline="always")
def _split_ends(pool, start, num, groups, g, take, counts) -> None:
    """Copy the ends of the `take` largest groups to the pool, group after group (one pass)."""
    for j in range(g):
        groups[4, j] = -1
    at = counts[N_POOL]
    for j in range(take):
        groups[4, groups[2, j]] = at
        at += groups[1, j]
    for i in range(num):
        gid = groups[3, i]
        if gid >= 0 and groups[4, gid] >= 0:
            pool[groups[4, gid]] = pool[start + i]
            groups[4, gid] += 1


@njit(cache=True, inline="always")
def _push_children(cols, tok, n_tok, factor, gain, calibrate, params, bank, s_cur, s_raw,
                   s_cand, s_cand_f, ranked, pool, groups, counts, slot, prob, head,
                   room, node_src) -> None:
    """Each cursor offers its best min(breadth, room) continuations, `room` being the nodes the
    tree can still take: a cursor ranks its continuations by one calibrated factor times a
    decreasing raw estimate, so its r-th can only be placed after its r - 1 better ones and never
    through this cursor alone. Nor does a cursor offer a continuation whose path probability
    does not beat the room-th candidate ranked when the cursor starts (`_threshold`; the
    candidates of earlier cursors of this expansion count, at their estimates then): it could
    never be placed through this cursor either, and its later continuations rank lower still,
    so the cursor stops there. A token another cursor also offers can still be placed; it then
    lacks this cursor's evidence and continuations. The threshold cuts the continuations offered
    without changing what is accepted.

    A corpus cursor continues only under the root and under nodes the corpus won (`node_src`,
    -1 for the root): under a node the request or the trie won, its continuations took slots
    from better candidates more often than they were accepted."""
    limit = min(params[P_LIMIT], room)
    corpus_limit = limit if node_src < 0 or node_src == CORPUS else 0
    first_cand = counts[N_CAND]
    c = head
    while c != -1:
        src, length, wild = s_cur[C_SRC, c], s_cur[C_LEN, c], s_cur[C_WILD, c]
        threshold = _threshold(ranked, counts, s_cand_f, room)
        src_gain = gain[src]
        if src == TRIE:
            node = s_cur[C_A, c]
            total = cols[node, tk.CNT] if node != tk.ROOT else _root_total(cols, params)
            # Under the trie fallback's first token, its most frequent follower only: more
            # followers are accepted no more often and take room from better candidates.
            breadth = limit if not wild or node == tk.ROOT else 1
            cls = _class(src, total, wild)
            f = _factor(factor, calibrate, cls, length)
            child = cols[node, tk.FIRST]
            taken = 0
            while child != -1 and taken < breadth:
                raw = cols[child, tk.CNT] / (total + 1)
                est, base = _estimate(f, raw, src_gain)
                if prob * est <= threshold:
                    break
                kid = _new_cursor(s_cur, counts, src, child, 0, 0, length + 1, cls, wild)
                if cols[child, tk.FIRST] >= 0:  # what expanding it reads first
                    ht.prefetch(cols, cols[child, tk.FIRST])
                _offer(s_cur, s_raw, s_cand, s_cand_f, ranked, counts, first_cand, slot,
                       cols[child, tk.TOK], src, est, base, kid, raw, prob, room)
                child = cols[child, tk.NEXT]
                taken += 1
        elif src == CORPUS:
            edges = bank[2]
            # A corpus cursor carries its state's edge range and occurrences (kernels/sam.py).
            lo, hi, total = s_cur[C_A, c], s_cur[C_OFF, c], s_cur[C_B, c]
            cls = _class(src, total, 0)
            f = _factor(factor, calibrate, cls, length)
            for e in range(lo, min(hi, lo + corpus_limit)):
                occ = edges[e, sk.E_OCC]
                raw = occ / (total + 1)
                est, base = _estimate(f, raw, src_gain)
                if prob * est <= threshold:
                    break
                kid = _new_cursor(s_cur, counts, src, edges[e, sk.E_LO], occ,
                                  edges[e, sk.E_HI], length + 1, cls, 0)
                ht.prefetch(edges, edges[e, sk.E_LO])  # what expanding it reads
                _offer(s_cur, s_raw, s_cand, s_cand_f, ranked, counts, first_cand, slot,
                       edges[e, sk.E_TOKEN], src, est, base, kid, raw, prob, room)
        else:
            start, num, off = s_cur[C_A, c], s_cur[C_B, c], s_cur[C_OFF, c]
            g = _context_groups(tok, n_tok, pool, start, num, off, groups)
            cls = _class(src, num, wild)
            f = _factor(factor, calibrate, cls, length)
            take = min(g, limit)
            # The ends of every group that may be offered; a group cut by the threshold leaves
            # its copy unclaimed (the next cursor's split writes over it).
            _split_ends(pool, start, num, groups, g, take, counts)
            for j in range(take):  # the groups' estimates decrease with their sizes
                t, size = groups[0, j], groups[1, j]
                raw = size / (num + 1)
                est, base = _estimate(f, raw, src_gain)
                if prob * est <= threshold:
                    break
                at = counts[N_POOL]
                counts[N_POOL] += size
                kid = _new_cursor(s_cur, counts, src, at, size, off + 1, length + 1, cls, wild)
                _offer(s_cur, s_raw, s_cand, s_cand_f, ranked, counts, first_cand, slot, t, src,
                       est, base, kid, raw, prob, room)
        c = s_cur[C_NEXT, c]


@njit(cache=True, inline="always")
def _link(s_cur, head, tail, c) -> tuple:
    """Append cursor c to the list head..tail; returns the new (head, tail)."""
    if tail == -1:
        return c, c
    s_cur[C_NEXT, tail] = c
    return head, c


@njit(cache=True, inline="always")
def _root_total(cols, params) -> int:
    """The trie root's occurrences for the trie fallback: the counts of its first `breadth`
    children (the most frequent tokens), which are all it ever offers."""
    total, child, taken = 0, cols[tk.ROOT, tk.FIRST], 0
    while child != -1 and taken < params[P_LIMIT]:
        total += cols[child, tk.CNT]
        child = cols[child, tk.NEXT]
        taken += 1
    return total


@njit(cache=True, inline="always")
def _root_cursors(cols, edges, tmeta, tstate, trie_start, tok, prev, cst, params, bank, s_cur,
                  pool, counts, work) -> int:
    """Context anchors, then distinct-count trie anchors, then each corpus's anchors."""
    k_max = params[P_ANCHORS]
    m, starts, nums = work[:k_max], work[k_max:2 * k_max], work[2 * k_max:3 * k_max]
    n = cst[cx.NUM]
    found, used = cx.anchors(prev, cst, params[P_MAX_MATCH], k_max, params[P_OCC], m, starts,
                             nums, pool, 0)
    new_token = found == 0  # no earlier occurrence of the last token in the request's text
    wild = 0
    for w in range(1, params[P_WILDCARDS] + 1):
        if found:
            break
        found, used = cx.anchors_at(tok, prev, n - 1 - w, params[P_MAX_MATCH], k_max,
                                    params[P_OCC], m, starts, nums, pool, 0)
        wild = w
    counts[N_POOL] = used
    head, tail = -1, -1
    for i in range(found):
        # A wildcard match's continuation is `wild` tokens past its ends.
        c = _new_cursor(s_cur, counts, CONTEXT, starts[i], nums[i], wild, m[i] + wild, -1,
                        1 if wild else 0)
        head, tail = _link(s_cur, head, tail, c)
    tk.refresh(cols, edges, tmeta, tstate, tok[trie_start:], n - trie_start)
    last_count, num_trie = -1, 0
    for k in range(tstate[0] - 1, -1, -1):
        node = tstate[1 + k]
        if node < 0 or cols[node, tk.FIRST] == -1:
            continue
        count = cols[node, tk.CNT]
        if count != last_count and num_trie < k_max:
            # A shorter suffix with an equal count has the same occurrences: skip it.
            c = _new_cursor(s_cur, counts, TRIE, node, 0, 0, k + 1, -1, 0)
            head, tail = _link(s_cur, head, tail, c)
            last_count, num_trie = count, num_trie + 1
    if new_token and params[P_TRIE_FALLBACK] and cols[tk.ROOT, tk.FIRST] != -1:
        # The most frequent tokens, then their bigrams, as a match of length 0: after a new
        # word the next token is often a common one (`.`, `,`, ` the`, a newline).
        c = _new_cursor(s_cur, counts, TRIE, tk.ROOT, 0, 0, 0, -1, 1)
        head, tail = _link(s_cur, head, tail, c)
    # The matches were fed this step's tokens before the builds (step.py `_catch_up_batch`).
    states, roots, match = bank[0], bank[3], bank[4]
    if roots.shape[0] == 0:
        return head
    for k in range(roots.shape[0]):
        # Suffix-link climb from the match: states with >= 1 continuation, longest first.
        state, length = match[k, sk.M_STATE], match[k, sk.M_LEN]
        for _ in range(k_max):
            state = sk.anchor_state(states, roots[k], state)
            if state == roots[k]:
                break
            c = _new_cursor(s_cur, counts, CORPUS, states[state, sk.S_EDGE],
                            states[state, sk.S_OCC], states[state + 1, sk.S_EDGE],
                            min(length, states[state, sk.S_LEN]), -1, 0)
            head, tail = _link(s_cur, head, tail, c)
            state = states[state, sk.S_LINK]
    return head


@njit(cache=True, inline="always")
def build(cols, edges, tmeta, tstate, tok, prev, cst, cal, settings, params, budget,
          min_path_prob, s_ints, s_floats, r_ints, r_floats, stats, bank, work) -> int:
    """Fill the request's tree and evidence (`request_views`) from its context, the trie and the
    corpus bank (kernels/sam.py: states, trans, edges, roots and the request's match rows; no
    corpus is empty tables; work: int64 scratch of >= 3 anchors); returns the node count, which
    is also left in r_ints[R_PENDING] for the commit that follows."""
    s_cur, s_raw, s_cand, s_cand_f, ranked, pool, groups, counts = _scratch_views(
        s_ints, s_floats, params)
    out_i, ev_i, ev_off, out_p, ev_raw, out_base, gain_sums = request_views(
        r_ints, r_floats, params)
    factor = cal[3]  # calibration factors [class, bucket]
    calibrate = params[P_CALIBRATE] != 0
    gain = request_gains(gain_sums, settings)  # by source
    n_tok = cst[cx.NUM]
    counts[:] = 0
    out_i[0, 0], out_i[1, 0], out_i[2, 0], out_p[0] = tok[n_tok - 1], -1, -1, 1.0
    out_base[0] = 1.0
    ev_off[0], ev_off[1] = 0, 0
    r_ints[R_PENDING] = 1
    if budget <= 0:
        return 1
    head = _root_cursors(cols, edges, tmeta, tstate, r_ints[R_TRIE_START], tok, prev, cst,
                         params, bank, s_cur, pool, counts, work)
    # Expand the root, then each placed node: one call site, since the kernels inline it.
    n, e, parent, prob, node_src = 1, 0, 0, 1.0, -1
    while True:
        _push_children(cols, tok, n_tok, factor, gain, calibrate, params, bank, s_cur, s_raw,
                       s_cand, s_cand_f, ranked, pool, groups, counts, parent, prob, head,
                       budget + 1 - n, node_src)
        if counts[N_RANKED] == 0:
            break
        k = _take_best(ranked, counts, budget - n)
        prob = -s_cand_f[1, k]
        if prob < min_path_prob:
            break
        src = s_cand[K_SRC, k]
        out_i[0, n], out_i[1, n], out_i[2, n] = s_cand[K_TOK, k], s_cand[K_SLOT, k], src
        out_p[n], out_base[n] = prob, s_cand_f[2, k]
        c = s_cand[K_HEAD, k]
        while c != -1:
            ev_i[0, e], ev_i[1, e], ev_raw[e] = s_cur[C_CLS, c], s_cur[C_LEN, c] - 1, s_raw[c]
            e += 1
            c = s_cur[C_NEXT, c]
        stats[src] += 1
        n += 1
        ev_off[n] = e
        if n > budget:  # children of the last node could never be placed
            break
        parent, head, node_src = n - 1, s_cand[K_HEAD, k], src
    r_ints[R_PENDING] = n
    return n
