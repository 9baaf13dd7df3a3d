"""Draft trees: `token_ids` plus `parents`, stored best-first.

Node 0 is the root: the last committed token, whose K/V is not yet cached. Every other node i
has `parents[i] < i`, so any prefix of the arrays is itself a valid (smaller) tree. Masks,
depths, paths and sibling links are derived, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DraftTree:
    token_ids: list[int]  # [n] node 0 = root (last committed token)
    parents: list[int]  # [n] parents[0] == -1, parents[i] < i
    # Estimated probability that the whole root-to-node path is accepted (probs[0] == 1.0).
    # Best-first order means probs never increases along the arrays' order of expansion.
    probs: list[float] = field(default_factory=list)
    # Which drafting source produced each node (see spec.sources); -1 for the root.
    sources: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a draft tree needs at least its root node")
        if len(self.parents) != n:
            raise ValueError(f"parents has {len(self.parents)} entries, token_ids has {n}")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parents[0] == -1)")
        for i in range(1, n):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"parents[{i}] = {self.parents[i]} is not in [0, {i})")
        if not self.probs:
            self.probs = [1.0] * n
        if not self.sources:
            self.sources = [-1] * n
        if len(self.probs) != n or len(self.sources) != n:
            raise ValueError("probs and sources must have one entry per node")

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        return cls([root_token], [-1], [1.0], [-1])

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids) - 1

    def prefix(self, num_drafts: int) -> DraftTree:
        """The best `num_drafts` drafts plus the root: still a valid tree (best-first order)."""
        n = 1 + max(0, min(num_drafts, self.num_drafts))
        return DraftTree(
            self.token_ids[:n], self.parents[:n], self.probs[:n], self.sources[:n]
        )

    def depths(self) -> list[int]:
        depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def positions(self, root_position: int) -> list[int]:
        """Absolute positions: the root sits at `root_position`, a node one past its parent."""
        return [root_position + d for d in self.depths()]

    def ancestor_mask(self) -> list[list[bool]]:
        """mask[i][j] is True iff j is i itself or an ancestor of i (SGLang's tree mask)."""
        return ancestor_mask(self.parents)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            kids[self.parents[i]].append(i)
        return kids

    def leaves(self) -> list[int]:
        has_child = [False] * len(self.parents)
        for p in self.parents[1:]:
            has_child[p] = True
        return [i for i, c in enumerate(has_child) if not c and i > 0]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf token paths, root excluded, in leaf order."""
        return [[self.token_ids[i] for i in self.path_to(leaf)] for leaf in self.leaves()]

    def first_child_next_sibling(self) -> tuple[list[int], list[int]]:
        """SGLang's retrieve_next_token / retrieve_next_sibling arrays (-1 = none)."""
        n = len(self.parents)
        first_child = [-1] * n
        next_sibling = [-1] * n
        last_child = [-1] * n
        for i in range(1, n):
            p = self.parents[i]
            if first_child[p] == -1:
                first_child[p] = i
            else:
                next_sibling[last_child[p]] = i
            last_child[p] = i
        return first_child, next_sibling

    def child_with_token(self, node: int, token: int) -> int:
        """Index of `node`'s child carrying `token`, or -1."""
        for i in range(node + 1, len(self.parents)):
            if self.parents[i] == node and self.token_ids[i] == token:
                return i
        return -1

    def accepted_nodes(self, next_tokens: list[int]) -> list[int]:
        """Longest root-to-node path whose tokens equal `next_tokens` (greedy acceptance)."""
        node, path = 0, []
        for token in next_tokens:
            node = self.child_with_token(node, token)
            if node < 0:
                break
            path.append(node)
        return path


def ancestor_mask(parents: list[int]) -> list[list[bool]]:
    """mask[i][j] is True iff j is i itself or an ancestor of i, for parent indices (-1: a root;
    every parent before its child)."""
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i][:i] = mask[parent][:i]
        mask[i][i] = True
    return mask
