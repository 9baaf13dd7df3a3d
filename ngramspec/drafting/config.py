"""Drafter configuration: our n-gram drafter and a faithful SGLang preset share one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from ngramspec.drafting.index.sam import SuffixAutomaton

# The trie (drafting/index/trie.py) needs 47-53 B per node fully grown (a 36 B record plus two
# id-only hash tables), i.e. 0.14 GiB at 3M nodes and 0.79 GiB at 16M. SGLang's C++ node is 176 B
# and preallocated (10M nodes = 1.76 GB up front); ours grow on demand, so capacity is a bound,
# not an up-front cost.
DEFAULT_CAPACITY = 3_000_000
SGLANG_CAPACITY = 10_000_000
MAX_WILDCARDS = 4


class CorpusSnapshot(Protocol):
    def snapshot(self) -> dict[str, SuffixAutomaton]:
        """The external corpora in use now, by name (a consistent view)."""


@dataclass(slots=True)
class DrafterConfig:
    preset: Literal["ngramspec", "sglang"] = "ngramspec"  # "ngramspec" (ours) | "sglang" (faithful SGLang NGRAM)
    draft_token_num: int = 12  # tree size including the root (SGLang's d); drafts = d - 1
    # D: longest n-gram stored in the trie. SGLang uses 18; ours stops at 5 because the request's
    # own context index covers the long matches: deeper accepts no more, and every committed
    # token counts D n-grams into a trie that grows with D.
    max_trie_depth: int = 5
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10  # also the top-k children read per node by our drafter
    match_type: Literal["BFS", "PROB"] = "BFS"  # "BFS" | "PROB" (sglang preset only)
    capacity: int = DEFAULT_CAPACITY  # trie nodes
    external_sam_budget: int = 0  # sglang preset: draft nodes reserved for external SAMs
    external_corpus_max_tokens: int = 10_000_000
    # ---- ngramspec knobs
    max_context_match: int = 16  # longest suffix looked up in the request's own context
    max_sam_match: int = 24  # longest suffix looked up in an external corpus
    # More anchors or occurrences accept no more (docs/benchmarks.md) and cost more: the most
    # recent occurrences of a match predict its continuation best.
    max_context_occurrences: int = 4
    max_anchors_per_source: int = 2  # matched suffix lengths per source expanded into the tree
    # For a step whose last token has no earlier occurrence in the request's own text (a new
    # name, number or word: 40% of the steps of the recorded streams):
    # - wildcard matches: match the tokens before the last w = 1 .. max_wildcards tokens instead
    #   and draft what followed w tokens after those earlier matches (`foo(a, X)` then
    #   `foo(a, Y)`: the same `)` and line after);
    # - the trie fallback: the trie's root as a match of length 0 (the most frequent tokens,
    #   then their bigrams): after a new word the next token is often a common one (`.`, `,`,
    #   ` the`, a newline), which no match offers.
    # Both are calibrated in classes of their own (calibration.py), and each raises acceptance.
    max_wildcards: int = 1
    trie_fallback: bool = True
    min_path_prob: float = 0.0  # nodes whose estimated path acceptance is below are not drafted
    insert_prompt: bool = True  # put prompts into the global trie (count once)
    calibrate: bool = True  # learn acceptance per (source, match length) online
    calibration_prior_weight: float = 8.0  # pseudo-trials behind the prior factor of a bucket
    # A request's own recent acceptance per source scales its estimates (calibration.py): the
    # gains' prior in pseudo-trials (0: off) and the decay of their sums per verify step (the
    # defaults were the best of a sweep over replays).
    request_gain_prior: float = 1.0
    request_gain_decay: float = 0.9
    # Threads that build a batch's trees (the queued commits stay on one): the trees are the same
    # for any count. Meant for cores that idle while an accelerator runs; 1 by default because
    # torch's own threads compete for the cores, and on a CPU the forward wants every core.
    draft_threads: int = 1

    def __post_init__(self) -> None:
        _check(self.preset in ("ngramspec", "sglang"), "preset", "must be 'ngramspec' or 'sglang'")
        _check(self.match_type in ("BFS", "PROB"), "match_type", "must be 'BFS' or 'PROB'")
        _check(self.draft_token_num > 0, "draft_token_num", "must be > 0")
        _check(self.max_trie_depth > 1, "max_trie_depth", "must be > 1")
        _check(self.min_bfs_breadth > 0, "min_bfs_breadth", "must be > 0")
        _check(
            self.max_bfs_breadth >= self.min_bfs_breadth,
            "max_bfs_breadth", f"must be >= min_bfs_breadth ({self.min_bfs_breadth})",
        )
        # SGLang lacks this check and crashes in squeeze() when capacity <= D (#36495).
        _check(
            self.capacity > self.max_trie_depth,
            "capacity", f"must be > max_trie_depth ({self.max_trie_depth})",
        )
        _check(
            0 <= self.external_sam_budget < self.draft_token_num,
            "external_sam_budget",
            f"must be in [0, draft_token_num - 1 = {self.draft_token_num - 1}]",
        )
        _check(self.external_corpus_max_tokens > 0, "external_corpus_max_tokens", "must be > 0")
        for name in ("max_context_match", "max_sam_match", "max_context_occurrences",
                     "max_anchors_per_source"):
            _check(getattr(self, name) > 0, name, "must be > 0")
        _check(0 <= self.max_wildcards <= MAX_WILDCARDS, "max_wildcards",
               f"must be in [0, {MAX_WILDCARDS}]")
        _check(0.0 <= self.min_path_prob < 1.0, "min_path_prob", "must be in [0, 1)")
        _check(0 < self.calibration_prior_weight < math.inf, "calibration_prior_weight",
               "must be finite and > 0")
        _check(0 <= self.request_gain_prior < math.inf, "request_gain_prior",
               "must be finite and >= 0 (0: off)")
        _check(0.0 < self.request_gain_decay <= 1.0, "request_gain_decay", "must be in (0, 1]")
        _check(1 <= self.draft_threads <= 256, "draft_threads", "must be in [1, 256]")

    @property
    def num_draft_tokens(self) -> int:
        """Draft nodes per tree, root excluded (SGLang's get_draft_token_num)."""
        return self.draft_token_num - 1

    @classmethod
    def sglang(cls, **overrides: object) -> DrafterConfig:
        """SGLang's server defaults: d=12, D=18, breadth 1..10, BFS, capacity 10M.

        The 10M capacity is SGLang's; there it preallocates 1.76 GB. Our nodes are allocated on
        demand, so it is a bound, not an up-front cost.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields: {unknown}")
        base = cls(preset="sglang", draft_token_num=12, max_trie_depth=18, min_bfs_breadth=1,
                   max_bfs_breadth=10, match_type="BFS", capacity=SGLANG_CAPACITY,
                   external_sam_budget=0, external_corpus_max_tokens=10_000_000)
        return replace(base, **overrides)  # replace() re-runs validation


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"DrafterConfig.{field_name} {message}")
