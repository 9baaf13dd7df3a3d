"""SGLang's NGRAM trie (`trie.h/.cpp`): a fixed node pool of n-grams up to `max_depth` tokens.

Faithful to upstream on purpose, flaws included (see docs/reference/sglang_ngram.md §2.2-§2.3, §8):
- `insert(window)` adds every suffix of the window truncated to `max_depth`, so an n-gram is
  re-counted on every step it stays inside the sliding window;
- eviction (`squeeze`) removes exactly the deficit, leaves only, in global-LRU order, no decay;
- per-request `MatchState`s advance incrementally and can miss suffixes that other requests
  inserted after the state cached them as absent ("stale anchors"); `exact_match=True` always
  rebuilds instead.
The one deliberate difference: `capacity > max_depth` is validated (upstream crashes, #36495).

Node ids stand in for C++ pointers; a `NodeRef` is `(node, version)` and stops resolving once
the node is evicted (version bump) or the trie is reset (epoch bump).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from types import MappingProxyType
from typing import cast

NodeRef = tuple[int, int]  # (node id, node version at capture time)
# Shared by every childless node: most nodes are leaves, and a dict each would double memory.
# Read-only, so a missed copy-on-write fails loudly instead of sharing children.
_NO_KIDS = cast(dict[int, int], MappingProxyType({}))


@dataclass(slots=True)
class MatchState:
    """Per-request cached anchors: anchors[k-1] is the node of the length-k context suffix."""

    epoch: int = 0  # 0 never equals a live trie epoch, so a fresh state always rebuilds
    processed_total_len: int = 0
    anchors: list[NodeRef | None] = field(default_factory=list)


class SGLangTrie:
    """Global n-gram trie with a node pool of `capacity` nodes (the root takes one)."""

    def __init__(self, capacity: int, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be > 1, got {max_depth}")
        if capacity <= max_depth:
            raise ValueError(
                f"capacity must exceed max_depth ({max_depth}) so squeeze can always make room, "
                f"got {capacity}"
            )
        self.capacity = capacity
        self.max_depth = max_depth
        self.epoch = 0
        self.reset()

    # -- pool -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every n-gram; the epoch bump invalidates all cached MatchStates at once."""
        self.epoch += 1
        self._token: list[int] = []
        self._parent: list[int] = []
        self._freq: list[int] = []
        self._version: list[int] = []
        # Per node: child token -> child node, ordered LEAST recently inserted/touched first
        # (a plain dict re-inserts in O(1) at the end). It plays both `child` and the
        # reversed `lru` of the C++ node.
        self._kids: list[dict[int, int]] = []
        self._free_ids: list[int] = []
        self._lru: OrderedDict[int, None] = OrderedDict()  # front = most recent; root excluded
        self.root = self._new_node(-1, -1)

    @property
    def num_free(self) -> int:
        return self.capacity - (len(self._token) - len(self._free_ids))

    @property
    def num_nodes(self) -> int:
        """Live nodes, root included."""
        return self.capacity - self.num_free

    def _new_node(self, token: int, parent: int) -> int:
        if self._free_ids:
            node = self._free_ids.pop()
            self._token[node], self._parent[node], self._freq[node] = token, parent, 1
            self._kids[node] = _NO_KIDS
            return node
        self._token.append(token)
        self._parent.append(parent)
        self._freq.append(1)
        self._version.append(1)  # a default NodeRef never resolves (C++ versions start at 1)
        self._kids.append(_NO_KIDS)
        return len(self._token) - 1

    # -- insert / evict ---------------------------------------------------------------------

    def insert(self, window: list[int]) -> None:
        """Insert every suffix of `window`, each truncated to `max_depth` tokens."""
        n = len(window)
        for start in range(n):
            segment = window[start : start + min(n - start, self.max_depth)]
            if len(segment) > self.num_free:
                self.squeeze(len(segment) - self.num_free)
            self._insert_path(segment)

    def _insert_path(self, segment: list[int]) -> None:
        kids_of, freq, lru = self._kids, self._freq, self._lru  # hot loop: D^2/2 edges a step
        node, path = self.root, []
        for token in segment:
            kids = kids_of[node]
            if kids is _NO_KIDS:
                kids = kids_of[node] = {}
            child = kids.pop(token, None)
            if child is None:
                child = self._new_node(token, node)
                lru[child] = None  # C++ pushes new nodes to the back first
            else:
                freq[child] += 1
            kids[token] = child  # (re)inserted last = most recent
            path.append(child)
            node = child
        # Deepest first, so every ancestor ends up in front of its descendants: the global
        # LRU tail is then always a leaf, which squeeze relies on.
        move = lru.move_to_end
        for child in reversed(path):
            move(child, last=False)

    def squeeze(self, count: int) -> None:
        """Evict exactly `count` nodes from the global-LRU tail (always leaves)."""
        if self.num_free + count > self.capacity:
            raise RuntimeError(f"cannot release {count} nodes: only {self.num_nodes} in use")
        for _ in range(count):
            node, _ = self._lru.popitem(last=True)
            if self._kids[node]:
                raise RuntimeError(f"global LRU tail {node} still has children")
            parent = self._parent[node]
            del self._kids[parent][self._token[node]]
            if not self._kids[parent]:
                self._kids[parent] = _NO_KIDS
            self._version[node] += 1  # retire: cached NodeRefs to it stop resolving
            self._free_ids.append(node)

    # -- node access (for the tree builders) ------------------------------------------------

    def token(self, node: int) -> int:
        return self._token[node]

    def freq(self, node: int) -> int:
        return self._freq[node]

    def parent(self, node: int) -> int:
        return self._parent[node]

    def child(self, node: int, token: int) -> int | None:
        return self._kids[node].get(token)

    def has_children(self, node: int) -> bool:
        return bool(self._kids[node])

    def children_by_recency(self, node: int, limit: int) -> list[tuple[int, int]]:
        """First `limit` (token, child), most recently inserted or touched first (C++ `lru`)."""
        return list(islice(reversed(self._kids[node].items()), limit))

    def children_by_freq(self, node: int, top_k: int) -> list[tuple[int, int, int]]:
        """First `top_k` of the C++ `sorted_children` multiset: (token, child, freq) by
        freq desc then token asc (tokens are unique among siblings, so the order is total)."""
        freq = self._freq
        kids = self._kids[node].items()
        best = heapq.nsmallest(top_k, kids, key=lambda kv: (-freq[kv[1]], kv[0]))
        return [(token, child, freq[child]) for token, child in best]

    def lru_order(self) -> list[int]:
        """Global LRU, most recent first (for tests)."""
        return list(self._lru)

    # -- matching ---------------------------------------------------------------------------

    def capture(self, node: int) -> NodeRef:
        return (node, self._version[node])

    def resolve(self, state: MatchState, ref: NodeRef | None) -> int | None:
        if ref is None or state.epoch != self.epoch or self._version[ref[0]] != ref[1]:
            return None
        return ref[0]

    def match(
        self, context: list[int], state: MatchState, total_len: int, exact: bool = False
    ) -> list[tuple[int, int]]:
        """Expandable anchors `(node, match_len)`, longest suffix first (upstream `match`).

        The state advances by the `total_len - processed_total_len` tokens appended since the
        last call when it can; otherwise (or with `exact`) it is rebuilt from `context`.
        """
        appended = total_len - state.processed_total_len
        can_advance = (
            not exact
            and state.epoch == self.epoch
            and 0 <= appended <= len(context)
            and len(state.anchors) == min(state.processed_total_len, self.max_depth)
        )
        tail = context[len(context) - appended :] if appended > 0 else []
        if not (can_advance and self._advance(state, tail, total_len)):
            self._rebuild(state, context, total_len)
        return self._expandable(state)

    def _rebuild(self, state: MatchState, context: list[int], total_len: int) -> None:
        depth = min(len(context), self.max_depth)
        state.epoch, state.processed_total_len = self.epoch, total_len
        state.anchors = [None] * depth
        for k in range(1, depth + 1):
            node: int | None = self.root
            for token in context[len(context) - k :]:
                node = self._kids[node].get(token)
                if node is None:
                    break
            if node is not None:
                state.anchors[k - 1] = self.capture(node)

    def _advance(self, state: MatchState, tokens: list[int], total_len: int) -> bool:
        if any(ref is not None and self.resolve(state, ref) is None for ref in state.anchors):
            return False
        for token in tokens:
            depth = min(len(state.anchors) + 1, self.max_depth)
            nxt: list[NodeRef | None] = [None] * depth
            child = self._kids[self.root].get(token)
            if child is not None:
                nxt[0] = self.capture(child)
            # NOTE: only cached non-null anchors are extended; a suffix that was absent when
            # cached stays absent here even if it has been inserted since (upstream caveat).
            for k in range(1, depth):
                node = self.resolve(state, state.anchors[k - 1])
                if node is not None:
                    child = self._kids[node].get(token)
                    if child is not None:
                        nxt[k] = self.capture(child)
            state.anchors = nxt
        state.processed_total_len = total_len
        return True

    def _expandable(self, state: MatchState) -> list[tuple[int, int]]:
        out = []
        for k in range(len(state.anchors), 0, -1):
            node = self.resolve(state, state.anchors[k - 1])
            if node is not None and self._kids[node]:
                out.append((node, k))
        return out
