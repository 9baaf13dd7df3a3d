"""PrefixCache: the K/V of earlier tokens, indexed by token prefix, for requests that share one.

A token trie (a radix tree with one token per edge, since our KV slots are token-granular, not
blocks): node = one token at one position and the KV slot holding its K/V. A token's K/V depends
only on the tokens before it, and the CPU kernels are batch-invariant (a token's numbers are
bitwise the same whatever it was computed with), so a request whose prompt starts with a
cached path reuses those slots and its output is unchanged.

Why a trie rather than hashed blocks (vLLM): slots are token-granular here, so any shared prefix
is reused to the token, with no block rounding and no copy of a partly filled block.

This is an index only: the scheduler owns every slot. It inserts a sequence's committed tokens
(its prompt once prefilled, everything at finish), locks the path a running sequence uses
(`ref`, counted on every node of the path), and asks for least-recently-used unlocked leaves
when it needs slots back (`evict` returns their slots for the scheduler to free). Draft slots
never enter: only committed tokens are inserted.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Node:
    token: int
    slot: int
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    ref: int = 0  # sequences whose locked path runs through this node
    last_used: int = 0  # the cache's clock at the last lookup or unlock


class PrefixCache:
    def __init__(self) -> None:
        self.root = Node(-1, -1, None)
        self.root.ref = 1  # never evicted
        self.num_nodes = 0  # slots the cache holds
        self.num_evictable = 0  # of them, those no running sequence uses (ref == 0)
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, Node]] = []  # (last_used, tiebreak, node), lazy
        self._tiebreak = itertools.count()
        self.hits = 0  # tokens served from the cache (prefill skipped)
        self.queries = 0  # tokens looked up

    # ---- lookups ----------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[Node, list[int]]:
        """The deepest cached path along `tokens` (locked for the caller) and its slots."""
        node, slots, now = self.root, [], next(self._clock)
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            node.last_used = now
            slots.append(node.slot)
        self.lock(node, self.root)
        self.queries += len(tokens)
        self.hits += len(slots)
        return node, slots

    def insert(self, node: Node, tokens: list[int], slots: list[int]) -> tuple[Node, int]:
        """Extend the locked path ending at `node` with `tokens` (their K/V in `slots`), taking
        over the slots of the new nodes. Stops where the trie already holds the next token in
        another slot (someone else computed it: the caller keeps and later frees its own).
        Returns the new locked end and how many tokens the cache took."""
        start, taken = node, 0
        for token, slot in zip(tokens, slots):
            child = node.children.get(token)
            if child is None:
                child = Node(token, slot, node)
                node.children[token] = child
                self.num_nodes += 1
                self.num_evictable += 1  # lock() below takes it back
            elif child.slot != slot:
                break
            node = child
            taken += 1
        self.lock(node, start)
        return node, taken

    # ---- locking ------------------------------------------------------------------------------
    def lock(self, node: Node, above: Node) -> None:
        """+1 on every node from `node` up to, not including, `above` (already locked)."""
        while node is not above and node is not None:
            if node.ref == 0:
                self.num_evictable -= 1
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """-1 on the path from `node` to the root; nodes nobody uses become evictable."""
        now = next(self._clock)
        while node is not self.root:
            node.ref -= 1
            node.last_used = now
            if node.ref == 0:
                self.num_evictable += 1
                if not node.children:
                    self._push_leaf(node)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Free up to `n` slots, least recently used unlocked leaves first; their slots."""
        freed: list[int] = []
        while len(freed) < n and self._leaves:
            used, _, node = heapq.heappop(self._leaves)
            if node.ref or node.children or node.parent is None or used != node.last_used:
                continue  # stale entry: locked, grown, already evicted or used since
            parent = node.parent
            del parent.children[node.token]
            node.parent = None
            freed.append(node.slot)
            self.num_nodes -= 1
            self.num_evictable -= 1
            if parent is not self.root and parent.ref == 0 and not parent.children:
                self._push_leaf(parent)
        return freed

    def clear(self) -> list[int]:
        """Evict everything unlocked (flush); the freed slots."""
        return self.evict(self.num_evictable)

    def _push_leaf(self, node: Node) -> None:
        heapq.heappush(self._leaves, (node.last_used, next(self._tiebreak), node))

    def slots(self) -> list[int]:
        """Every slot the cache holds (tests)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.slot)
            stack.extend(node.children.values())
        return out
