"""RequestGrammar: one request's grammar state, and what speculation does with it.

- `constrain(tree)`: puts the tokens the grammar forces first (a chain with probability 1, the
  drafter's subtree grafted below it when the drafter agreed), then drops every node the
  grammar forbids, so no verify row is spent on a token that can never be emitted.
- `bitmasks(tree)`: the allowed-token bitmask after every node (the matcher walks the tree
  depth-first and rolls back), the same mask plain decoding would compute at that position,
  so masked verification emits exactly what plain constrained decoding emits.
- `advance(token)`: the engine feeds every emitted token; "stop" once the grammar is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from llguidance import LLMatcher

from ngramspec.drafting.sources import GRAMMAR
from ngramspec.drafting.tree import DraftTree


class GrammarViolation(RuntimeError):
    """An emitted token the grammar does not allow (a bug) or a grammar that hit its limits."""


class RequestGrammar:
    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_words = (vocab_size + 31) // 32

    # ---- emitted tokens -------------------------------------------------------------------
    def advance(self, token: int) -> str | None:
        """Consume one emitted token; "stop" when the grammar allows nothing more."""
        if token in self.eos_token_ids and self.matcher.is_accepting():
            return "stop"
        if not self.matcher.consume_token(token):
            raise GrammarViolation(f"token {token} breaks the grammar: "
                                   f"{self.matcher.get_error()[:200]}")
        return "stop" if self.matcher.is_stopped() else None

    # ---- drafts ---------------------------------------------------------------------------
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (each the only one it allows there)."""
        if self.matcher.is_stopped():
            return []
        tokens = self.matcher.compute_ff_tokens()
        return tokens[: self.matcher.validate_tokens(tokens)]

    def constrain(self, tree: DraftTree) -> DraftTree:
        """Forced tokens first, then the drafter's nodes the grammar allows (best-first kept)."""
        forced = self.forced_tokens()
        if forced:
            tree = graft_forced(tree, forced)
        return keep_nodes(tree, self._walk(tree, lambda node: None))

    def eos_allowed(self) -> bool:
        """EOS may come next: the grammar is complete but could also go on (a finished
        grammar stops the request at its last token, so EOS never follows it)."""
        return self.matcher.is_accepting() and not self.matcher.is_stopped()

    def bitmasks(self, tree: DraftTree) -> torch.Tensor:
        """Row i: the tokens allowed after node i's path. Nodes the grammar forbids (never on an
        accepted path) keep an all-zero row."""
        # -> [len(tree), num_words] int32, bit t of word w allows token 32 w + t
        masks = torch.zeros(len(tree), self.num_words, dtype=torch.int32)
        row_bytes = self.num_words * 4
        self._walk(tree, lambda node: self.matcher.unsafe_compute_mask_ptr(
            masks[node].data_ptr(), row_bytes))
        if self.matcher.is_error():
            raise GrammarViolation(f"the grammar failed: {self.matcher.get_error()[:200]}")
        return masks

    def _walk(self, tree: DraftTree, at_node: Callable[[int], None]) -> list[bool]:
        """Depth-first over the nodes whose path the grammar allows, calling `at_node(i)` with
        the matcher at node i (it consumes the path, then rolls back). An EOS node is never
        entered: it is allowed, as a leaf, where the grammar may end. Returns which nodes are
        allowed."""
        allowed = [False] * len(tree)
        children = tree.children()

        def visit(node: int) -> None:
            allowed[node] = True
            at_node(node)
            for child in children[node]:
                token = tree.token_ids[child]
                if token in self.eos_token_ids:
                    allowed[child] = self.eos_allowed()
                elif self.matcher.try_consume_tokens([token]) == 1:
                    visit(child)
                    self.matcher.rollback(1)

        visit(0)
        return allowed


def graft_forced(tree: DraftTree, forced: list[int]) -> DraftTree:
    """root -> forced[0] -> ... -> forced[-1] (probability 1), and below it the drafter's
    subtree under the same path when the drafter proposed all of it (its probabilities taken
    conditional on that path). Nodes off the forced path contradict the grammar: dropped."""
    anchor = 0
    for token in forced:
        anchor = tree.child_with_token(anchor, token)
        if anchor < 0:
            break
    n = len(forced)
    token_ids, parents = [tree.token_ids[0], *forced], list(range(-1, n))
    probs, sources = [1.0] * (n + 1), [tree.sources[0]] + [GRAMMAR] * n
    if anchor >= 0:
        new_index = {anchor: n}
        base = tree.probs[anchor] or 1.0
        for i in range(anchor + 1, len(tree)):
            parent = tree.parents[i]
            if parent in new_index:
                new_index[i] = len(token_ids)
                token_ids.append(tree.token_ids[i])
                parents.append(new_index[parent])
                probs.append(min(1.0, tree.probs[i] / base))
                sources.append(tree.sources[i])
    return DraftTree(token_ids, parents, probs, sources)


def keep_nodes(tree: DraftTree, keep: list[bool]) -> DraftTree:
    """The nodes marked kept (every kept node's parent must be kept), order preserved."""
    if all(keep):
        return tree
    new_index: dict[int, int] = {}
    token_ids, parents, probs, sources = [], [], [], []
    for i, kept in enumerate(keep):
        if kept:
            new_index[i] = len(token_ids)
            token_ids.append(tree.token_ids[i])
            parents.append(-1 if i == 0 else new_index[tree.parents[i]])
            probs.append(tree.probs[i])
            sources.append(tree.sources[i])
    return DraftTree(token_ids, parents, probs, sources)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  eos_token_ids: tuple[int, ...]) -> None:
    """Forbidden tokens' logits to -inf, in place. A row that allows nothing (a grammar that
    failed) allows EOS instead, so no row is all -inf (which would sample NaN)."""
    # logits: [n, V] float; bitmask: [n, W] int32 on the CPU, bit t of word w = token 32 w + t
    vocab = logits.shape[1]
    words = bitmask.numpy().view(np.uint32).copy()
    for row in np.flatnonzero(~words.any(axis=1)):
        for eos in eos_token_ids:
            words[row, eos // 32] |= np.uint32(1 << (eos % 32))
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little", count=vocab)
    # An additive bias of 0 or -inf, built as float bit patterns: a branch-free add is ~10x
    # faster than masked_fill/where, whose cost follows the mask's (unpredictable) pattern.
    bias = ((1 - allowed).astype(np.int32) * _NEG_INF_BITS).view(np.float32)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy, on this thread: a torch op this small still wakes the whole thread pool
        np.add(logits.numpy(), bias, out=logits.numpy())
    else:
        logits.add_(torch.from_numpy(bias).to(logits.device, logits.dtype))


_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000: float32 -inf
