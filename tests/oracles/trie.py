"""Global n-gram trie learned online across requests.

Unlike SGLang (which re-inserts a D-token window every step and so counts one occurrence up to
D times), every n-gram occurrence is counted exactly once: a request keeps the trie nodes of the
suffixes (lengths 1..D) ending at its last token, and committing token t extends each of them by
t. That is O(D) dict operations per committed token and gives `count(node)` = the number of
occurrences of the node's n-gram (until eviction forgets some).

Eviction removes only leaves, least recently touched first, and never the nodes a request is
extending right now. Node ids are recycled, so request states hold (node, version) pairs: an
evicted node's version is bumped and the request re-probes that suffix from the root.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ngramspec.drafting.index.sam import SEPARATOR
from ngramspec.drafting.index.trie import check_trie_meta, trie_meta

ROOT = 0
_SPAN = 2**31  # edge key = parent * _SPAN + token (tokens are int32 >= 0; separators never stored)


@dataclass(slots=True)
class ReferenceTrieState:
    """A request's suffix anchors: anchors[k-1] is the node of its last k tokens."""

    anchors: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    epoch: int = -1


class ReferenceTrie:
    def __init__(self, capacity: int, max_depth: int) -> None:
        if max_depth < 1 or capacity <= max_depth:
            raise ValueError(f"trie capacity ({capacity}) must exceed max_depth ({max_depth})")
        self.capacity = capacity
        self.max_depth = max_depth
        self.epoch = 0
        self._clear()

    def _clear(self) -> None:
        # Parallel per-node lists; ids are recycled through `_free`.
        self._token: list[int] = [SEPARATOR]
        self._parent: list[int] = [-1]
        self._count: list[int] = [0]
        self._version: list[int] = [0]
        self._pos: list[int] = [0]  # index in the parent's `_kids`
        # One edge dict for the whole trie: (parent, token) -> node. A dict per node would
        # cost ~180 B each on CPython; this keeps a node near 200 B.
        self._edges: dict[int, int] = {}
        # Children sorted by count desc. array('q'), not list: arrays are invisible to the
        # cyclic GC, which otherwise rescans millions of small lists (multi-ms pauses).
        self._kids: list[array | None] = [None]
        self._free: list[int] = []
        self._leaves: OrderedDict[int, None] = OrderedDict()  # front = least recently touched
        self.num_evicted = 0

    def reset(self) -> None:
        """Forget every n-gram; outstanding TrieStates become invalid (epoch bump)."""
        self.epoch += 1
        self._clear()

    def new_state(self) -> ReferenceTrieState:
        return ReferenceTrieState()

    @property
    def num_nodes(self) -> int:
        """Live nodes, root included (at most `capacity`)."""
        return len(self._token) - len(self._free)

    # ----------------------------------------------------------------- reads

    def count(self, node: int) -> int:
        return self._count[node]

    def token(self, node: int) -> int:
        return self._token[node]

    def child(self, node: int, token: int) -> int:
        return self._edges.get(node * _SPAN + token, -1)

    def children(self, node: int, limit: int | None = None) -> list[tuple[int, int, int]]:
        """(token, child, count), most frequent first."""
        kids = self._kids[node]
        if kids is None:
            return []
        if limit is not None:
            kids = kids[:limit]
        token, count = self._token, self._count
        return [(token[c], c, count[c]) for c in kids]

    def has_children(self, node: int) -> bool:
        return self._kids[node] is not None

    def lookup(self, tokens: list[int]) -> int:
        """Node of the n-gram `tokens` (root for []), or -1."""
        node = ROOT
        for t in tokens:
            node = self.child(node, t)
            if node < 0:
                return -1
        return node

    def anchors(self, state: ReferenceTrieState, context: list[int]) -> list[tuple[int, int]]:
        """(node, length) for suffixes of `context` present with >= 1 child, longest first.

        Never stale: evicted anchors and lengths missing from the state (capacity pressure)
        are re-probed from the root, so the result equals a stateless walk.
        """
        self._refresh(state, context)
        kids = self._kids
        return [
            (node, k + 1)
            for k, node in reversed(list(enumerate(state.anchors)))
            if node >= 0 and kids[node] is not None
        ]

    def _refresh(self, state: ReferenceTrieState, context: list[int]) -> None:
        if state.epoch != self.epoch:
            state.anchors, state.versions, state.epoch = [], [], self.epoch
        limit = _run_length(context, self.max_depth)
        anchors, versions, version = state.anchors, state.versions, self._version
        del anchors[limit:], versions[limit:]
        n = len(context)
        for k in range(limit):
            if k < len(anchors):
                if anchors[k] >= 0 and version[anchors[k]] == versions[k]:
                    continue
                anchors[k] = self.lookup(context[n - k - 1 :])
                versions[k] = version[anchors[k]] if anchors[k] >= 0 else 0
            else:
                node = self.lookup(context[n - k - 1 :])
                anchors.append(node)
                versions.append(version[node] if node >= 0 else 0)

    # ----------------------------------------------------------------- writes

    def extend(self, state: ReferenceTrieState, context: list[int], start: int) -> None:
        """Count the n-grams ending at context[start:], the tokens just appended.

        `state` must describe the suffixes ending at context[start - 1] (as left by the
        previous call); a fresh state with start == 0 inserts the whole context.
        """
        if state.epoch != self.epoch:
            state.anchors, state.versions, state.epoch = [], [], self.epoch
            if start > 0:
                self._refresh(state, context[:start])
        for pos in range(start, len(context)):
            self._advance(state, context, pos)

    def _advance(self, state: ReferenceTrieState, context: list[int], pos: int) -> None:
        token = context[pos]
        if token == SEPARATOR:  # n-grams never span documents
            state.anchors, state.versions = [], []
            return
        old, old_versions, version = state.anchors, state.versions, self._version
        new: list[int] = []
        for k in range(min(self.max_depth, pos + 1)):
            if k == 0:
                parent = ROOT
            elif k <= len(old) and old[k - 1] >= 0 and version[old[k - 1]] == old_versions[k - 1]:
                parent = old[k - 1]
            else:  # evicted or never stored: re-probe the k tokens before `token`
                if context[pos - k] == SEPARATOR:
                    break
                parent = self.lookup(context[pos - k : pos])
                if parent < 0:
                    break
            child = self._count_child(parent, token, old, new)
            if child < 0:
                break
            new.append(child)
        state.anchors = new
        state.versions = [version[n] for n in new]

    def _count_child(self, parent: int, token: int, old: list[int], new: list[int]) -> int:
        child = self._edges.get(parent * _SPAN + token, -1)
        if child < 0:
            return self._create(parent, token, old, new)
        count = self._count[child] + 1
        self._count[child] = count
        self._bubble_up(parent, child, count)
        if self._kids[child] is None:
            self._leaves.move_to_end(child)
        return child

    def _bubble_up(self, parent: int, child: int, count: int) -> None:
        """Keep siblings sorted by count after `child` went from count - 1 to count.

        Swap it with the first sibling of its old count (O(log n) search, O(1) move): a
        frequent token's node can have thousands of count-1 siblings to jump over.
        """
        siblings = self._kids[parent]
        pos, counts = self._pos, self._count
        i = pos[child]
        if i == 0 or counts[siblings[i - 1]] >= count:
            return
        j = bisect_right(siblings, -count, 0, i, key=lambda n: -counts[n])
        other = siblings[j]
        siblings[j], siblings[i] = child, other
        pos[child], pos[other] = j, i

    def _create(self, parent: int, token: int, old: list[int], new: list[int]) -> int:
        node = self._allocate(parent, old, new)
        if node < 0:
            return -1
        self._token[node], self._parent[node], self._count[node] = token, parent, 1
        self._kids[node] = None
        if self._kids[parent] is None:
            self._kids[parent] = array("q")
            if parent != ROOT:
                del self._leaves[parent]  # no longer a leaf
        self._edges[parent * _SPAN + token] = node
        self._pos[node] = len(self._kids[parent])
        self._kids[parent].append(node)
        self._leaves[node] = None
        return node

    def _allocate(self, parent: int, old: list[int], new: list[int]) -> int:
        if self._free:
            return self._free.pop()
        if len(self._token) < self.capacity:
            for column in (self._token, self._parent, self._count, self._pos):
                column.append(0)
            self._version.append(1)
            self._kids.append(None)
            return len(self._token) - 1
        pinned = set(old) | set(new)
        pinned.add(parent)
        if not self._evict_one(pinned):
            return -1
        return self._free.pop()

    def _evict_one(self, pinned: set[int]) -> bool:
        victim = next((n for n in self._leaves if n not in pinned), -1)
        if victim < 0:
            return False
        del self._leaves[victim]
        parent = self._parent[victim]
        siblings = self._kids[parent]
        i = self._pos[victim]
        del siblings[i]
        for j in range(i, len(siblings)):
            self._pos[siblings[j]] = j
        del self._edges[parent * _SPAN + self._token[victim]]
        if not siblings:
            self._kids[parent] = None
            if parent != ROOT:
                # Its whole subtree went cold, so it is the next eviction candidate.
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)
        self._version[victim] += 1
        self._free.append(victim)
        self.num_evicted += 1
        return True

    # ----------------------------------------------------------------- persistence

    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Live nodes in BFS order (parents first, children in count order) plus leaf LRU."""
        order = [ROOT]
        for node in order:
            order.extend(self._kids[node] or ())
        index = {node: i for i, node in enumerate(order)}
        arrays = {
            "token": np.asarray([self._token[n] for n in order], dtype=np.int64),
            "parent": np.asarray([index.get(self._parent[n], -1) for n in order], dtype=np.int64),
            "count": np.asarray([self._count[n] for n in order], dtype=np.int64),
            "lru": np.asarray([index[n] for n in self._leaves], dtype=np.int64),
        }
        return trie_meta(self.capacity, self.max_depth, len(order)), arrays

    @classmethod
    def from_arrays(cls, meta: dict, arrays: dict[str, np.ndarray]) -> ReferenceTrie:
        check_trie_meta(meta, arrays)
        trie = cls(int(meta["capacity"]), int(meta["max_depth"]))
        tokens, parents = arrays["token"].tolist(), arrays["parent"].tolist()
        counts = arrays["count"].tolist()
        for node in range(1, len(tokens)):
            trie._restore_node(node, tokens[node], parents[node], counts[node])
        trie._leaves = OrderedDict((int(n), None) for n in arrays["lru"].tolist())
        return trie

    def _restore_node(self, node: int, token: int, parent: int, count: int) -> None:
        if not 0 <= parent < node:
            raise ValueError(f"trie node {node} has parent {parent}; parents must come first")
        kids = self._kids[parent]
        if count < 1 or (kids is not None and self._count[kids[-1]] < count):
            # Bubbling relies on sorted siblings (and the fast trie on runs of equal counts).
            raise ValueError(f"trie node {node}: counts must be >= 1, children in count order")
        for column, value in ((self._token, token), (self._parent, parent),
                              (self._count, count), (self._version, 1)):
            column.append(value)
        self._kids.append(None)
        if self._kids[parent] is None:
            self._kids[parent] = array("q")
        self._edges[parent * _SPAN + token] = node
        self._pos.append(len(self._kids[parent]))
        self._kids[parent].append(node)


def _run_length(context: list[int], cap: int) -> int:
    """Tokens after the last separator, at most `cap` (suffixes never reach across one)."""
    n = len(context)
    for i in range(n - 1, max(-1, n - 1 - cap), -1):
        if context[i] == SEPARATOR:
            return n - 1 - i
    return min(cap, n)
