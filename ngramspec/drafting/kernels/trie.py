"""numba kernels of the global trie (drafting/index/trie.py owns the arrays; the semantics
are tests/oracles/trie.py's).

Node records (`cols`, int32 [allocated, NUM_COLS]; one 36-byte row per node, so a node is one
cache line):
  TOK, PAR, CNT         token, parent, occurrence count
  FIRST, NEXT, PREV     children as a linked list sorted by count desc; PREV of the first child
                        is the last child (O(1) append), NEXT of the last is -1
  LPREV, LNEXT          the leaf LRU list (front = least recently touched); until the trie
                        first fills, a leaf's last-touch stamp instead (high, low 31 bits)
  VER                   bumped when the id is evicted, so request anchors can tell staleness
Two id-only hash tables (kernels/hashtab.py): `edges` keyed (PAR, TOK) holding every node that has
a sibling (an only child is found through its parent's FIRST, so chains, most of a deep trie,
cost no hashing), and `runs` keyed (PAR, CNT),
the latter holding the first child of each run of two or more equal-count siblings. The run head
is what `ReferenceTrie._bubble_up` finds by bisection: an incremented child swaps with it (same
tie-breaking).
`meta` (int64): NUM, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH, STAMP (the next touch stamp),
LINKED (1 once the LRU is a list).

Until the trie first needs to evict, the LRU is only stamps: touching a leaf writes its own row,
where the list's upkeep rewrote three others' (its neighbours and the tail). Counting a token's
n-grams cost as much as indexing it in the request's context, and a trie that never fills paid
for an order it never read. When the first eviction comes, `_link_lru` links the leaves in stamp
order, which is the list the upkeep would have built (the same touches in the same order), and
from then on the list is kept as before.
A request state (int32 [1 + 2 * depth]): count, anchors[depth], versions[depth].
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ngramspec.drafting.kernels import hashtab as ht

TOK, PAR, CNT, FIRST, NEXT, PREV, LPREV, LNEXT, VER = range(9)
NUM_COLS = 9
NUM, LRU_HEAD, LRU_TAIL, EVICTED, CAPACITY, DEPTH, STAMP, LINKED = range(8)
STAMP_BITS = 31  # a stamp's low part (LNEXT); the high part is in LPREV
SEPARATOR = -(2**31)
ROOT = 0


# ---------------------------------------------------------------- sibling list


@njit(cache=True, inline="always")
def _unlink(cols: np.ndarray, x: int) -> None:
    p, nx, pv = cols[x, PAR], cols[x, NEXT], cols[x, PREV]
    first = cols[p, FIRST]
    if first == x:
        cols[p, FIRST] = nx
        if nx != -1:
            cols[nx, PREV] = pv  # pv is the last child
    else:
        cols[pv, NEXT] = nx
        if nx == -1:
            cols[first, PREV] = pv
        else:
            cols[nx, PREV] = pv


@njit(cache=True)
def _insert_after(cols: np.ndarray, x: int, y: int) -> None:
    nx = cols[y, NEXT]
    cols[y, NEXT], cols[x, PREV], cols[x, NEXT] = x, y, nx
    if nx == -1:
        cols[cols[cols[y, PAR], FIRST], PREV] = x
    else:
        cols[nx, PREV] = x


@njit(cache=True)
def _insert_before(cols: np.ndarray, x: int, y: int) -> None:
    p = cols[y, PAR]
    if cols[p, FIRST] == y:
        cols[x, PREV], cols[x, NEXT] = cols[y, PREV], y
        cols[y, PREV], cols[p, FIRST] = x, x
    else:
        _insert_after(cols, x, cols[y, PREV])


@njit(cache=True, inline="always")
def _append_child(cols: np.ndarray, p: int, x: int) -> None:
    first = cols[p, FIRST]
    cols[x, NEXT] = -1
    if first == -1:
        cols[p, FIRST], cols[x, PREV] = x, x
    else:
        last = cols[first, PREV]
        cols[last, NEXT], cols[x, PREV], cols[first, PREV] = x, last, x


@njit(cache=True, inline="always")
def _swap(cols: np.ndarray, a: int, b: int) -> None:
    """Exchange the list positions of siblings a (earlier) and b (later)."""
    if cols[a, NEXT] == b:
        _unlink(cols, a)
        _insert_after(cols, a, b)
        return
    after_a, before_b = cols[a, NEXT], cols[b, PREV]
    _unlink(cols, b)
    _insert_before(cols, b, after_a)
    _unlink(cols, a)
    _insert_after(cols, a, before_b)


# ---------------------------------------------------------------- leaf LRU


@njit(cache=True, inline="always")
def _lru_remove(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    p, x = cols[n, LPREV], cols[n, LNEXT]
    if p != -1:
        cols[p, LNEXT] = x
    else:
        meta[LRU_HEAD] = x
    if x != -1:
        cols[x, LPREV] = p
    else:
        meta[LRU_TAIL] = p


@njit(cache=True, inline="always")
def _lru_append(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    tail = meta[LRU_TAIL]
    cols[n, LPREV], cols[n, LNEXT] = tail, -1
    if tail != -1:
        cols[tail, LNEXT] = n
    else:
        meta[LRU_HEAD] = n
    meta[LRU_TAIL] = n


@njit(cache=True, inline="always")
def _lru_push_front(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    head = meta[LRU_HEAD]
    cols[n, LPREV], cols[n, LNEXT] = -1, head
    if head != -1:
        cols[head, LPREV] = n
    else:
        meta[LRU_TAIL] = n
    meta[LRU_HEAD] = n


@njit(cache=True, inline="always")
def _touch(cols: np.ndarray, meta: np.ndarray, n: int) -> None:
    """Leaf n was counted (or, in stamp mode, created): the tail of the LRU (module docstring)."""
    if meta[LINKED]:
        if meta[LRU_TAIL] != n:
            _lru_remove(cols, meta, n)
            _lru_append(cols, meta, n)
        return
    stamp = meta[STAMP]
    meta[STAMP] = stamp + 1
    cols[n, LPREV], cols[n, LNEXT] = stamp >> STAMP_BITS, stamp & ((1 << STAMP_BITS) - 1)


@njit(cache=True)
def stamp_order(cols: np.ndarray, num: int) -> np.ndarray:
    """The leaves (root excluded) of a trie still in stamp mode, least recently touched first."""
    leaves = np.empty(num, np.int64)
    k = 0
    for n in range(1, num):
        if cols[n, FIRST] == -1:
            leaves[k] = n
            k += 1
    leaves = leaves[:k]
    stamps = np.empty(k, np.int64)
    for i in range(k):
        n = leaves[i]
        stamps[i] = (np.int64(cols[n, LPREV]) << STAMP_BITS) | cols[n, LNEXT]
    return leaves[np.argsort(stamps)]


@njit(cache=True)
def _link_lru(cols: np.ndarray, meta: np.ndarray) -> None:
    """Leave stamp mode: link the leaves in stamp order."""
    meta[LRU_HEAD], meta[LRU_TAIL] = -1, -1
    for n in stamp_order(cols, meta[NUM]):
        _lru_append(cols, meta, n)
    meta[LINKED] = 1


# ---------------------------------------------------------------- counting


@njit(cache=True, inline="always")
def _same_before(cols: np.ndarray, n: int, c: int) -> bool:
    """n has a previous sibling of count c."""
    return cols[cols[n, PAR], FIRST] != n and cols[cols[n, PREV], CNT] == c


@njit(cache=True, inline="always")
def _same_after(cols: np.ndarray, n: int, c: int) -> bool:
    """n has a next sibling of count c."""
    return cols[n, NEXT] != -1 and cols[cols[n, NEXT], CNT] == c


@njit(cache=True, inline="always")
def _increment(cols: np.ndarray, runs: np.ndarray, child: int) -> None:
    """count += 1, then swap with the head of the old count's run (ReferenceTrie._bubble_up).

    `runs` holds the heads of runs of two or more equal-count siblings only, so the common
    case (a child alone with its count, e.g. on a chain) needs no hashing at all.
    """
    p, c = cols[child, PAR], cols[child, CNT] + 1
    if _same_before(cols, child, c - 1):  # not the head: the run has >= 2 members
        head = ht.find(runs, cols, PAR, CNT, p, c - 1)
        _swap(cols, head, child)
    else:
        head = child
    if _same_after(cols, child, c - 1):  # the old run had >= 2 members: it keeps the rest
        nx = cols[child, NEXT]
        if _same_after(cols, nx, c - 1):
            ht.replace(runs, cols, PAR, CNT, head, nx)
        else:
            ht.remove(runs, cols, PAR, CNT, head)  # one member left: no entry
    cols[child, CNT] = c
    if _same_before(cols, child, c):
        before = cols[child, PREV]
        if not _same_before(cols, before, c):  # that run had one member, now two
            ht.insert(runs, before, ht.pair_key(p, c))


@njit(cache=True)
def _leave_run(cols: np.ndarray, runs: np.ndarray, v: int) -> None:
    """Update `runs` for v leaving its sibling list (its columns still intact)."""
    c = cols[v, CNT]
    before, after = _same_before(cols, v, c), _same_after(cols, v, c)
    if after and not before:  # v heads a run of >= 2
        nx = cols[v, NEXT]
        if _same_after(cols, nx, c):
            ht.replace(runs, cols, PAR, CNT, v, nx)
        else:
            ht.remove(runs, cols, PAR, CNT, v)
    elif before and not after:  # v ends a run of >= 2
        pv = cols[v, PREV]
        if not _same_before(cols, pv, c):
            ht.remove(runs, cols, PAR, CNT, pv)


@njit(cache=True)
def _pinned(n: int, parent: int, old: np.ndarray, num_old: int, new: np.ndarray,
            num_new: int) -> bool:
    if n == parent:
        return True
    for i in range(num_old):
        if old[i] == n:
            return True
    for i in range(num_new):
        if new[i] == n:
            return True
    return False


@njit(cache=True)
def _evict(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
           v: int) -> None:
    _lru_remove(cols, meta, v)
    p = cols[v, PAR]
    _leave_run(cols, runs, v)
    if cols[p, FIRST] != v or cols[v, NEXT] != -1:  # v has a sibling, so an entry
        ht.remove(edges, cols, PAR, TOK, v)
    _unlink(cols, v)
    only = cols[p, FIRST]
    if only != -1 and cols[only, NEXT] == -1:  # an only child again: no entry
        ht.remove(edges, cols, PAR, TOK, only)
    if cols[p, FIRST] == -1 and p != ROOT:
        # Its whole subtree went cold, so it is the next eviction candidate.
        _lru_push_front(cols, meta, p)
    cols[v, VER] += 1
    meta[EVICTED] += 1


@njit(cache=True)
def _allocate(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
              parent: int, old: np.ndarray, num_old: int, new: np.ndarray, num_new: int) -> int:
    num = meta[NUM]
    if num < cols.shape[0]:
        meta[NUM] = num + 1
        cols[num, VER] = 1
        return num
    if num < meta[CAPACITY]:
        return -2  # the caller did not grow the columns first (a bug)
    if not meta[LINKED]:
        _link_lru(cols, meta)
    v = meta[LRU_HEAD]
    while v != -1 and _pinned(v, parent, old, num_old, new, num_new):
        v = cols[v, LNEXT]
    if v == -1:
        return -1
    _evict(cols, edges, runs, meta, v)
    return v


@njit(cache=True, inline="always")
def _count_child(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
                 parent: int, token: int, old: np.ndarray, num_old: int, new: np.ndarray,
                 num_new: int) -> int:
    child = child_of(cols, edges, parent, token)
    if child >= 0:
        _increment(cols, runs, child)
        if cols[child, FIRST] == -1:
            _touch(cols, meta, child)
        return child
    node = _allocate(cols, edges, runs, meta, parent, old, num_old, new, num_new)
    if node < 0:
        return node
    cols[node, TOK], cols[node, PAR], cols[node, CNT], cols[node, FIRST] = token, parent, 1, -1
    first = cols[parent, FIRST]
    if first == -1:
        if parent != ROOT and meta[LINKED]:
            _lru_remove(cols, meta, parent)  # no longer a leaf (stamp mode: just not a leaf)
    else:
        last = cols[first, PREV]
        if cols[last, CNT] == 1 and not _same_before(cols, last, 1):
            ht.insert(runs, last, ht.pair_key(parent, 1))  # a run of one becomes two
        if cols[first, NEXT] == -1:  # the only child gets a sibling: now it needs an entry
            ht.insert(edges, first, ht.pair_key(parent, cols[first, TOK]))
        ht.insert(edges, node, ht.pair_key(parent, token))
    _append_child(cols, parent, node)
    if meta[LINKED]:
        _lru_append(cols, meta, node)
    else:
        _touch(cols, meta, node)
    return node


# ---------------------------------------------------------------- request anchors


@njit(cache=True, inline="always")
def child_of(cols: np.ndarray, edges: np.ndarray, parent: int, token: int) -> int:
    first = cols[parent, FIRST]  # the most frequent child: checked before any hashing
    if first == -1:
        return -1
    if cols[first, TOK] == token:
        return first
    if cols[first, NEXT] == -1:
        return -1
    return ht.find(edges, cols, PAR, TOK, parent, token)


@njit(cache=True, inline="always")
def lookup(cols: np.ndarray, edges: np.ndarray, ctx: np.ndarray, lo: int, hi: int) -> int:
    node = ROOT
    for i in range(lo, hi):
        node = child_of(cols, edges, node, ctx[i])
        if node < 0:
            return -1
    return node


@njit(cache=True)
def run_length(ctx: np.ndarray, n: int, cap: int) -> int:
    """Tokens after the last separator in ctx[:n], at most `cap`."""
    lo = max(-1, n - 1 - cap)
    for i in range(n - 1, lo, -1):
        if ctx[i] == SEPARATOR:
            return n - 1 - i
    return min(cap, n)


@njit(cache=True, inline="always")
def refresh(cols: np.ndarray, edges: np.ndarray, meta: np.ndarray, state: np.ndarray,
            ctx: np.ndarray, n: int) -> None:
    """Re-probe the stale or missing suffix anchors of ctx[:n] (ReferenceTrie._refresh)."""
    depth = meta[DEPTH]
    limit = run_length(ctx, n, depth)
    state[0] = min(state[0], limit)
    for k in range(limit):
        if k < state[0]:
            a = state[1 + k]
            if a >= 0 and cols[a, VER] == state[1 + depth + k]:
                continue
        else:
            state[0] = k + 1
        a = lookup(cols, edges, ctx, n - k - 1, n)
        state[1 + k] = a
        state[1 + depth + k] = cols[a, VER] if a >= 0 else 0


@njit(cache=True, inline="always")
def _prefetch_children(cols: np.ndarray, edges: np.ndarray, old: np.ndarray, num_old: int,
                       grams: int, token: int) -> None:
    """Ask for what counting `token` under each parent reads first (`child_of`): the parent's
    first child and the (parent, token) hash slot. The parents' own rows are warm (counted at
    the token before); the rest of a trie past L2 is not, and the n-grams are independent, so
    their misses overlap instead of coming one n-gram after another. A hint: a stale anchor
    only prefetches a line it does not read."""
    for k in range(grams):
        parent = ROOT
        if k > 0:
            if k > num_old or old[k - 1] < 0:
                return
            parent = old[k - 1]
        first = cols[parent, FIRST]
        if first >= 0:
            ht.prefetch(cols, first)
            ht.prefetch(edges, ht.home(edges, ht.pair_key(parent, token)))


@njit(cache=True, inline="always")
def extend(cols: np.ndarray, edges: np.ndarray, runs: np.ndarray, meta: np.ndarray,
           state: np.ndarray, ctx: np.ndarray, start: int, end: int, work: np.ndarray) -> int:
    """Count the n-grams ending at ctx[start:end] (ReferenceTrie._advance per token); 0 or -2.
    `work` (int64, >= 2 * depth) is scratch: an allocation here cost more than a token's count."""
    depth = meta[DEPTH]
    old = work[:depth]
    new = work[depth:2 * depth]
    for pos in range(start, end):
        token = ctx[pos]
        if token == SEPARATOR:  # n-grams never span documents
            state[0] = 0
            continue
        num_old = state[0]
        for i in range(num_old):
            old[i] = state[1 + i]
        _prefetch_children(cols, edges, old, num_old, min(depth, pos + 1), token)
        num_new = 0
        for k in range(min(depth, pos + 1)):
            if k == 0:
                parent = ROOT
            elif k <= num_old and old[k - 1] >= 0 and cols[old[k - 1], VER] == state[depth + k]:
                parent = old[k - 1]
            else:  # evicted or never stored: re-probe the k tokens before `token`
                if ctx[pos - k] == SEPARATOR:
                    break
                parent = lookup(cols, edges, ctx, pos - k, pos)
                if parent < 0:
                    break
            child = _count_child(cols, edges, runs, meta, parent, token, old, num_old, new,
                                 num_new)
            if child == -2:
                return -2
            if child < 0:
                break
            new[num_new] = child
            num_new += 1
        state[0] = num_new
        for i in range(num_new):
            state[1 + i] = new[i]
            state[1 + depth + i] = cols[new[i], VER]
    return 0
