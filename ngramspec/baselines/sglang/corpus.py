"""SGLang's `Ngram` corpus (`ngram.cpp` `batchMatch`) and its Python facade (`NgramCorpus`).

The raw API mirrors upstream so SGLang's unit tests port one to one:
`batch_put(windows)`, `batch_get(keys, contexts, total_lens) -> (tokens, mask)` flattened and
zero-padded to d per request, `erase_match_state`, `reset`, `leaf_paths_from_mask`.
Inserts are applied synchronously, which is what upstream's `synchronize()` guarantees before
every lookup anyway.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ngramspec.baselines.sglang.build import (
    ScratchTree,
    TreeResult,
    build_frequency,
    build_recency,
    combine,
    fill_result,
)
from ngramspec.baselines.sglang.trie import MatchState, SGLangTrie
from ngramspec.drafting.index.sam import SuffixAutomaton
from ngramspec.drafting.sources import CORPUS, TRIE


@dataclass(slots=True)
class SGLangParams:
    """The C++ `Param` plus our two switches (defaults = SGLang's server defaults,
    docs/reference/sglang_ngram.md §4.1)."""

    draft_token_num: int = 12  # d: tree size including the root
    max_trie_depth: int = 18  # D
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"  # "BFS" (recency) | "PROB" (frequency)
    capacity: int = 10_000_000  # trie nodes
    external_sam_budget: int = 0  # draft nodes reserved for external SAMs
    exact_match: bool = False  # True: rebuild anchors every step (no stale incremental anchors)
    insert_prompt: bool = False  # True: insert the prompt once at start (not upstream)

    def __post_init__(self) -> None:
        checks = (
            (self.draft_token_num > 0, "draft_token_num", "must be > 0"),
            (self.max_trie_depth > 1, "max_trie_depth", "must be > 1"),
            (self.min_bfs_breadth > 0, "min_bfs_breadth", "must be > 0"),
            (self.max_bfs_breadth >= self.min_bfs_breadth, "max_bfs_breadth",
             "must be >= min_bfs_breadth"),
            (self.match_type in ("BFS", "PROB"), "match_type", "must be 'BFS' or 'PROB'"),
            (self.capacity > self.max_trie_depth, "capacity", "must be > max_trie_depth"),
            (self.external_sam_budget >= 0, "external_sam_budget", "must be >= 0"),
        )
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"SGLangParams.{name} {message}")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> SGLangParams:
        """From a `DrafterConfig` (or anything with the same field names), or None."""
        if config is None or isinstance(config, cls):
            base = config or cls()
            values = {name: getattr(base, name) for name in cls.__dataclass_fields__}
        else:
            values = {
                name: getattr(config, name)
                for name in cls.__dataclass_fields__
                if hasattr(config, name) and name not in ("exact_match", "insert_prompt")
            }
        values.update(overrides)
        return cls(**values)


class SGLangCorpus:
    """The global trie, the external SAMs and the per-request match states."""

    def __init__(
        self, params: SGLangParams, sams: Mapping[str, SuffixAutomaton] | None = None
    ) -> None:
        self.params = params
        self.trie = SGLangTrie(params.capacity, params.max_trie_depth)
        self.sams: dict[str, SuffixAutomaton] = dict(sams or {})
        self._states: dict[Hashable, MatchState] = {}

    # -- corpus maintenance -----------------------------------------------------------------

    def batch_put(self, windows: Sequence[Sequence[int]]) -> None:
        for window in windows:
            self.trie.insert(list(window))

    def synchronize(self) -> None:
        """Inserts are synchronous here; kept for API parity with upstream."""

    def erase_match_state(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self._states.pop(key, None)

    def reset(self) -> None:
        """Clear the trie and every match state; the external SAMs are kept
        (docs/reference/sglang_ngram.md §1.3)."""
        self.trie.reset()
        self._states.clear()

    # -- lookup -----------------------------------------------------------------------------

    def budgets(self, total: int) -> tuple[int, int]:
        """(trie budget, per-SAM budget) for `total` draft nodes: the fixed split of
        docs/reference/sglang_ngram.md §2.6."""
        num_sams = len(self.sams)
        sam_total = min(self.params.external_sam_budget, total) if num_sams else 0
        per_sam = sam_total // num_sams if num_sams else 0
        if sam_total == 0 or per_sam == 0:
            return total, 0
        return total - per_sam * num_sams, per_sam

    def match_tree(
        self, key: Hashable, context: list[int], total_len: int, total: int | None = None
    ) -> TreeResult:
        """One request's tree with at most `total` drafts (default d - 1), unpadded."""
        if not context:
            raise ValueError("match_tree needs a non-empty context")
        total = self.params.draft_token_num - 1 if total is None else total
        state = self._states.setdefault(key, MatchState())
        trie_budget, per_sam = self.budgets(total)
        result = self._trie_tree(context, state, total_len, trie_budget)
        if per_sam == 0:
            return result
        for sam in self.sams.values():  # upstream: unordered_map order; ours: insertion order
            sam_result = self._sam_tree(sam, context, per_sam)
            result = combine(context[-1], total + 1, result, sam_result)
        return result

    def batch_get(
        self,
        keys: Sequence[Hashable],
        contexts: Sequence[Sequence[int]],
        total_lens: Sequence[int],
    ) -> tuple[list[int], list[int]]:
        """Upstream `batch_get`: flat tokens [bs*d] and flat mask [bs*d*d], zero padded."""
        if not len(keys) == len(contexts) == len(total_lens):
            raise ValueError("keys, contexts and total_lens must have the same length")
        n = self.params.draft_token_num
        tokens: list[int] = []
        mask: list[int] = []
        for key, context, total_len in zip(keys, contexts, total_lens):
            result = self.match_tree(key, list(context), total_len)
            row_tokens, row_mask = result.padded(n)
            tokens.extend(row_tokens)
            for row in row_mask:
                mask.extend(row)
        return tokens, mask

    def _trie_tree(
        self, context: list[int], state: MatchState, total_len: int, budget: int
    ) -> TreeResult:
        p = self.params
        anchors = self.trie.match(context, state, total_len, exact=p.exact_match)
        tree = ScratchTree(budget)
        if p.match_type == "BFS":
            build_recency(tree, anchors, self.trie.children_by_recency, p.max_trie_depth,
                          p.min_bfs_breadth, p.max_bfs_breadth, TRIE)
        else:
            build_frequency(tree, anchors, self.trie.children_by_freq, p.max_bfs_breadth, TRIE)
        return fill_result(context[-1], tree)

    def _sam_tree(self, sam: SuffixAutomaton, context: list[int], budget: int) -> TreeResult:
        p = self.params
        anchors = sam.match(context, p.max_trie_depth)
        tree = ScratchTree(budget)
        if p.match_type == "BFS":
            def recency(state: int, limit: int) -> list[tuple[int, int]]:
                return [(t, child) for t, child, _ in sam.children_by_recency(state, limit)]

            build_recency(tree, anchors, recency, p.max_trie_depth, p.min_bfs_breadth,
                          p.max_bfs_breadth, CORPUS)
        else:
            build_frequency(tree, anchors, lambda s, k: sam.children_by_freq(s, k),
                            p.max_bfs_breadth, CORPUS)
        return fill_result(context[-1], tree)


def parents_from_mask(mask: Sequence[Sequence[int]]) -> list[int]:
    """Parent of each node of an ancestor-or-self mask: the largest j < i with mask[i][j]."""
    return [-1] + [max(j for j in range(i) if mask[i][j]) for i in range(1, len(mask))]


def leaf_paths_from_mask(tokens: Sequence[int], mask: Sequence[Sequence[int]]) -> list[list[int]]:
    """Upstream debug helper: root-to-leaf token paths (root included) from (tokens, mask),
    in leaf order. Padding shows up as [root, 0] paths."""
    parents = parents_from_mask(mask)
    has_child = [False] * len(tokens)
    for p in parents[1:]:
        has_child[p] = True
    paths = []
    for leaf in range(len(tokens)):
        if has_child[leaf]:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        paths.append(path[::-1])
    return paths
