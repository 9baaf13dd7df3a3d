"""The `sglang` preset: SGLang's NGRAM drafter behind our `Drafter` protocol.

Per step, like SGLang's worker (docs/reference/sglang_ngram.md §1.3): the context is the last D tokens of
prompt + output, the tree is built from the global trie (+ external SAMs under the fixed
budget split), and after verification the same D-token window, ending at the old root, is
inserted. Prompts are not indexed (`insert_prompt=True` is the "strongest peer" variant).

Differences from upstream, all at the protocol boundary:
- trees are not zero-padded: an under-filled tree is just smaller (no token-0 ambiguity);
- `budget` can only shrink a tree: upstream always drafts d - 1 nodes;
- `probs` are placeholders, non-increasing in node order (PROB: running minimum of the path
  probability; BFS: 0.5 ** depth), since SGLang ranks nodes but never estimates acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ngramspec.baselines.sglang.build import TreeResult
from ngramspec.baselines.sglang.corpus import SGLangCorpus, SGLangParams
from ngramspec.drafting.sources import SOURCE_NAMES
from ngramspec.drafting.tree import DraftTree


@dataclass(slots=True)
class _Request:
    tail: list[int]  # the request's last tokens (at least the last D)
    total_len: int  # prompt + output length, SGLang's total_len
    stepped: bool = False  # proposed since the last commit: that commit ends a decode step
    tree: DraftTree | None = None  # the last proposal, to attribute accepted nodes


class SGLangDrafter:
    """Faithful SGLang NGRAM drafting; deterministic, no threads."""

    def __init__(
        self,
        config: Any = None,
        corpora: Any = None,
        *,
        insert_prompt: bool | None = None,
        exact_match: bool | None = None,
    ) -> None:
        """`config`: a `DrafterConfig`, an `SGLangParams` or None (SGLang's defaults).

        `insert_prompt` / `exact_match` are read only from here or from an `SGLangParams`:
        a `DrafterConfig`'s `insert_prompt` belongs to our own preset.
        """
        overrides = {
            name: value
            for name, value in (("insert_prompt", insert_prompt), ("exact_match", exact_match))
            if value is not None
        }
        self.params = SGLangParams.from_config(config, **overrides)
        self.corpus = SGLangCorpus(self.params)
        self._corpora = corpora
        self._requests: dict[str, _Request] = {}
        self._drafted = dict.fromkeys(SOURCE_NAMES, 0)
        self._accepted = dict.fromkeys(SOURCE_NAMES, 0)

    def start(
        self, request_id: str, prompt_ids: list[int], references: list[list[int]] | None = None
    ) -> None:
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token (the first tree root)")
        self.stop(request_id)
        self._requests[request_id] = _Request(list(prompt_ids[-self._keep :]), len(prompt_ids))
        if self.params.insert_prompt:
            # One insert per document counts each n-gram once (the windowed inserts of the
            # decode loop re-count them on every step).
            self.corpus.batch_put([prompt_ids, *(references or [])])

    def propose(self, request_ids: list[str], budgets: list[int]) -> list[DraftTree]:
        if len(request_ids) != len(budgets):
            raise ValueError("request_ids and budgets must have the same length")
        if self._corpora is not None:
            self.corpus.sams = dict(self._corpora.snapshot())
        return [self._propose_one(rid, budget) for rid, budget in zip(request_ids, budgets)]

    def _propose_one(self, request_id: str, budget: int) -> DraftTree:
        request = self._requests[request_id]
        request.stepped = True
        context = request.tail[-self.params.max_trie_depth :]
        total = min(budget, self.params.draft_token_num - 1)
        if total <= 0:
            request.tree = DraftTree.root_only(context[-1])
        else:
            result = self.corpus.match_tree(request_id, context, request.total_len, total)
            request.tree = to_draft_tree(result)
        for source in request.tree.sources[1:]:
            self._drafted[source] += 1
        return request.tree

    def commit(self, request_id: str, accepted_token_ids: list[int]) -> None:
        request = self._requests[request_id]
        if request.stepped:
            # SGLang inserts each decode step's context window after verification; nothing is
            # inserted for the token sampled at prefill (no proposal preceded it).
            self.corpus.batch_put([request.tail[-self.params.max_trie_depth :]])
            if request.tree is not None:
                for node in request.tree.accepted_nodes(accepted_token_ids):
                    self._accepted[request.tree.sources[node]] += 1
        request.stepped, request.tree = False, None
        request.tail.extend(accepted_token_ids)
        request.total_len += len(accepted_token_ids)
        if len(request.tail) > 2 * self._keep:
            del request.tail[: -self._keep]

    def stop(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.corpus.erase_match_state([request_id])

    def reset(self) -> None:
        """SGLang's flush_cache: clear the trie and match states, keep the external SAMs."""
        self.corpus.reset()

    def stats(self) -> dict[str, dict[str, int]]:
        """Draft nodes proposed and accepted per source name."""
        return {
            name: {"drafted": self._drafted[source], "accepted": self._accepted[source]}
            for source, name in SOURCE_NAMES.items()
        }

    @property
    def _keep(self) -> int:
        return self.params.max_trie_depth


def to_draft_tree(result: TreeResult) -> DraftTree:
    """Our tree in SGLang's node order; probs = running minimum of the builder scores."""
    probs, running = [], 1.0
    for score in result.scores:
        running = min(running, score)
        probs.append(running)
    return DraftTree(list(result.token_ids), list(result.parents), probs, list(result.sources))
