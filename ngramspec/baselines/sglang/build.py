"""SGLang's draft-tree builders (`Trie/SuffixAutomaton::buildRecency/buildFrequency`,
`fillResult`, `combineRootResults_`), generic over trie nodes and SAM states.

A builder grows a scratch tree of at most `budget` draft slots from a list of anchors (longest
match first). Equal tokens under the same scratch parent merge, so several anchors share one
tree. `fill_result` then numbers the slots breadth-first in libstdc++ hash-map order, which is
the order SGLang's golden tests pin down (docs/reference/sglang_ngram.md §2.4).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ngramspec.baselines.sglang.cxx import CxxIntMap, CxxMaxHeap

H = TypeVar("H")  # an anchor handle: trie node id or SAM state
# The first `limit` children as (token, child), most recently seen first.
RecencyChildren = Callable[[H, int], Sequence[tuple[int, H]]]
FreqChildren = Callable[[H, int], Sequence[tuple[int, H, int]]]  # top-k (token, child, count)


class ScratchTree:
    """`std::vector<Node> tree(budget + 1)`: slot 0 is the root; slots carry a score/source."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.next: list[CxxIntMap] = [CxxIntMap()]
        self.scores: list[float] = [1.0]  # PROB: path probability at allocation; BFS: 0.5**depth
        self.sources: list[int] = [-1]

    @property
    def cursor(self) -> int:
        return len(self.next)

    @property
    def full(self) -> bool:
        return self.cursor > self.budget

    def child(self, parent: int, token: int, score: float, source: int) -> int:
        """The slot for `token` under `parent`, allocated at the cursor if missing."""
        slot = self.next[parent].get(token)
        if slot is None:
            slot = self.cursor
            self.next[parent].insert(token, slot)
            self.next.append(CxxIntMap())
            self.scores.append(score)
            self.sources.append(source)
        return slot


def bfs_breadth_scale(max_depth: int, min_bfs: int, max_bfs: int) -> tuple[int, float]:
    """(M, scale): a k-token match starts at breadth (M - k) * scale + min_bfs."""
    m = max(1, max_depth - 1)
    return m, (max_bfs - min_bfs) / m


def build_recency(
    tree: ScratchTree,
    anchors: Sequence[tuple[H, int]],
    children: RecencyChildren,
    max_depth: int,
    min_bfs: int,
    max_bfs: int,
    source: int,
) -> ScratchTree:
    """BFS mode: per anchor, a breadth-limited BFS over most-recent-first children.

    Breadth shrinks by `scale` per level and is truncated to an int, floored at 1; a
    longer match starts narrower. Merged tokens cost no budget but are still re-enqueued.
    """
    m, scale = bfs_breadth_scale(max_depth, min_bfs, max_bfs)
    for anchor, match_len in anchors:
        queue = deque([(0, (m - match_len) * scale + min_bfs, anchor, 0)])
        while queue and not tree.full:
            parent, breadth, handle, depth = queue.popleft()
            for token, child in children(handle, max(1, int(breadth))):  # int() truncates
                if tree.full:
                    break
                slot = tree.child(parent, token, 0.5 ** (depth + 1), source)
                queue.append((slot, breadth - scale, child, depth + 1))
    return tree


def build_frequency(
    tree: ScratchTree,
    anchors: Sequence[tuple[H, int]],
    children: FreqChildren,
    top_k: int,
    source: int,
) -> ScratchTree:
    """PROB mode: best-first by path probability, each level normalised over its top-k
    children's counts. One heap is shared by all anchors and never cleared (as upstream)."""
    heap: CxxMaxHeap[tuple[int, H, int, float]] = CxxMaxHeap(key=lambda item: item[3])

    def push_children(parent: int, handle: H, prob: float) -> None:
        top = children(handle, top_k)
        total = float(sum(count for _, _, count in top))
        if total <= 0:
            total = 1.0
        for token, child, count in top:
            heap.push((parent, child, token, count / total * prob))

    for anchor, _ in anchors:
        push_children(0, anchor, 1.0)
        while heap and not tree.full:
            parent, handle, token, prob = heap.pop()
            push_children(tree.child(parent, token, prob, source), handle, prob)
    return tree


@dataclass(slots=True)
class TreeResult:
    """One request's materialised tree in SGLang's node order (root first, level order).

    Only the `num_valid` real nodes are stored; `padded()` adds upstream's zero padding.
    """

    token_ids: list[int]
    parents: list[int]  # parents[0] == -1
    scores: list[float]
    sources: list[int]

    @property
    def num_valid(self) -> int:
        return len(self.token_ids)

    def padded(self, n: int) -> tuple[list[int], list[list[int]]]:
        """Upstream output: n tokens (pad = 0, a root child) and the n x n ancestor mask."""
        tokens = self.token_ids[:n] + [0] * max(0, n - self.num_valid)
        parents = self.parents[:n] + [0] * max(0, n - self.num_valid)
        mask = [[0] * n for _ in range(n)]
        mask[0][0] = 1
        for i in range(1, n):
            mask[i][: parents[i] + 1] = mask[parents[i]][: parents[i] + 1]
            mask[i][i] = 1
        return tokens, mask


def fill_result(root_token: int, tree: ScratchTree) -> TreeResult:
    """Number the scratch slots breadth-first, children in hash-map iteration order."""
    result = TreeResult([root_token], [-1], [1.0], [-1])
    queue = deque((token, slot, 0) for token, slot in tree.next[0].items())
    while queue:
        token, slot, parent = queue.popleft()
        result.token_ids.append(token)
        result.parents.append(parent)
        result.scores.append(tree.scores[slot])
        result.sources.append(tree.sources[slot])
        index = len(result.token_ids) - 1
        queue.extend((t, s, index) for t, s in tree.next[slot].items())
    return result


def leaf_paths(result: TreeResult) -> list[list[int]]:
    """Root-excluded node-index paths to every leaf, in leaf order (`extractLeafPaths_`)."""
    has_child = [False] * result.num_valid
    for p in result.parents[1:]:
        has_child[p] = True
    paths = []
    for leaf in range(1, result.num_valid):
        if not has_child[leaf]:
            path, node = [], leaf
            while node > 0:
                path.append(node)
                node = result.parents[node]
            paths.append(path[::-1])
    return paths


def combine(root_token: int, n: int, primary: TreeResult, secondary: TreeResult) -> TreeResult:
    """`combineRootResults_`: re-insert primary then secondary leaf paths into one tree of at
    most `n` nodes (root included), sharing prefixes; a path may be cut short when full."""
    tree = ScratchTree(n - 1)
    for result in (primary, secondary):
        for path in leaf_paths(result):
            # Upstream drops `[0]` paths because that is what its padding rows look like; a
            # real depth-1 leaf with token 0 goes too (fixed later upstream with num_valid).
            if len(path) == 1 and result.token_ids[path[0]] == 0:
                continue
            parent = 0
            for node in path:
                token = result.token_ids[node]
                if tree.next[parent].get(token) is None and tree.full:
                    break
                parent = tree.child(parent, token, result.scores[node], result.sources[node])
            if tree.full:
                return fill_result(root_token, tree)
    return fill_result(root_token, tree)
