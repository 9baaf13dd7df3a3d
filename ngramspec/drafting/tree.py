"""Draft trees: `token_ids` plus `parents`, stored best-first.

Node 0 is the root: the last committed token, whose K/V is not yet cached. Every other node i
has `parents[i] < i`, so any prefix of the arrays is itself a valid (smaller) tree. Masks,
depths, paths and sibling links are derived, never stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


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
        return trusted_tree([root_token], [-1], [1.0], [-1])  # valid as written

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


def trusted_tree(tokens: list[int], parents: list[int], probs: list[float],
                 sources: list[int]) -> DraftTree:
    """A DraftTree without re-validating it, for trees whose arrays are valid by construction
    (a build kernel only ever emits parents < i; DraftBatch rows came from valid trees): the
    O(n) Python check cost ~10% of a whole engine step. Tests validate these trees."""
    tree = object.__new__(DraftTree)
    tree.token_ids, tree.parents, tree.probs, tree.sources = tokens, parents, probs, sources
    return tree


class DraftBatch(Sequence):
    """One propose's trees as arrays, row i for request i, read as DraftTrees only when asked.

    A drafter's trees are mostly cut by the engine's sizing (on a CPU often to the root), and
    turning a tree into Python lists costs a large share of a request-step. So the engine sizes
    the trees on these arrays and converts only the prefixes it verifies (`prefixes`); indexing or
    iterating converts every tree once, for readers that want them all (the replay, tests).
    Row i's first `sizes[i]` columns of each field are its nodes, best-first as in DraftTree;
    the columns after them are undefined. The int fields share one array, `ints` [B, 3W + 1]:
    tokens, parents, sources (W columns each), then the size (a numpy view costs ~0.2 µs, so
    the fields are views made when read, not when the drafter returns).
    """

    __slots__ = ("_trees", "ints", "probs")

    def __init__(self, ints: np.ndarray, probs: np.ndarray) -> None:
        width = probs.shape[1]
        if ints.shape != (probs.shape[0], 3 * width + 1):
            raise ValueError(f"ints {ints.shape} do not match probs {probs.shape}: expected "
                             f"({probs.shape[0]}, {3 * width + 1})")
        self.ints = ints  # int64 [B, 3W + 1]
        self.probs = probs  # float64 [B, W]: path probabilities
        self._trees: list[DraftTree] | None = None

    @classmethod
    def trusted(cls, ints: np.ndarray, probs: np.ndarray) -> DraftBatch:
        """A batch without the shape check, for arrays shaped by construction (the drafter's
        own): the check is a few percent of a request-step."""
        batch = object.__new__(cls)
        batch.ints, batch.probs, batch._trees = ints, probs, None
        return batch

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], min_width: int = 1) -> DraftBatch:
        """`trees` as a batch at least `min_width` columns wide (a batch that is: itself)."""
        if isinstance(trees, DraftBatch) and trees.width >= min_width:
            return trees
        width = max(min_width, *(len(t) for t in trees)) if trees else min_width
        ints: list[int] = []
        probs: list[float] = []
        for tree in trees:  # padded rows in one flat list per dtype, then one conversion each
            pad = [0] * (width - len(tree))
            ints += [*tree.token_ids, *pad, *tree.parents, *pad, *tree.sources, *pad, len(tree)]
            probs += [*tree.probs, *[0.0] * len(pad)]
        num = len(trees)
        return cls(np.fromiter(ints, np.int64, len(ints)).reshape(num, 3 * width + 1),
                   np.fromiter(probs, np.float64, len(probs)).reshape(num, width))

    @property
    def width(self) -> int:
        return self.probs.shape[1]

    @property
    def tokens(self) -> np.ndarray:  # int64 [B, W]
        return self.ints[:, :self.width]

    @property
    def parents(self) -> np.ndarray:  # int64 [B, W]
        return self.ints[:, self.width:2 * self.width]

    @property
    def sources(self) -> np.ndarray:  # int64 [B, W]
        return self.ints[:, 2 * self.width:3 * self.width]

    @property
    def sizes(self) -> np.ndarray:  # int64 [B]: nodes of each tree, root included, in 1..W
        return self.ints[:, 3 * self.width]

    def __len__(self) -> int:
        return len(self.probs)

    def __getitem__(self, i):  # int -> DraftTree, slice -> list[DraftTree]
        return self.trees()[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # mutable, compared by value

    def trees(self) -> list[DraftTree]:
        """Every tree whole, converted once (the same objects on every call)."""
        if self._trees is None:
            self._trees = self.prefixes(self.sizes.tolist())
        return self._trees

    def tree(self, i: int) -> DraftTree:
        """Row i as a new DraftTree (alone: no other row is converted)."""
        w, row = self.width, self.ints[i].tolist()
        n = row[3 * w]
        return _row_tree(row, self.probs[i, :n].tolist(), n, w)

    def prefixes(self, sizes: list[int]) -> list[DraftTree]:
        """New DraftTrees, tree i's first `sizes[i]` nodes (1 = its root alone). Rows that keep a
        draft are converted together: one conversion per array, not per tree."""
        if len(sizes) != len(self) or (np.asarray(sizes) > self.sizes).any():
            raise ValueError("prefix sizes must be one per tree and at most each tree's size")
        w = self.width
        rows = [i for i, k in enumerate(sizes) if k > 1]
        ints = iter(self.ints[rows].tolist())
        probs = iter(self.probs[rows].tolist())
        roots = self.ints[:, 0].tolist()
        out = []
        for i, k in enumerate(sizes):
            if k > 1:
                out.append(_row_tree(next(ints), next(probs), k, w))
            else:
                out.append(DraftTree.root_only(roots[i]))
        return out

    def replace(self, i: int, tree: DraftTree) -> None:
        """Row i becomes `tree`, cut to its best `width` nodes (a valid tree: best-first)."""
        n = min(len(tree), self.width)
        self.tokens[i, :n] = tree.token_ids[:n]
        self.parents[i, :n] = tree.parents[:n]
        self.probs[i, :n] = tree.probs[:n]
        self.sources[i, :n] = tree.sources[:n]
        self.sizes[i] = n
        self._trees = None


def _row_tree(ints: list[int], probs: list[float], n: int, width: int) -> DraftTree:
    """The first n nodes of one DraftBatch row (`ints`: tokens, parents, sources, `width`
    each; `probs`: path probabilities) as a DraftTree."""
    return trusted_tree(ints[:n], ints[width:width + n], probs[:n],
                        ints[2 * width:2 * width + n])


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
