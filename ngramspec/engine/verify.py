"""Tree verification: which draft nodes the target model accepts (greedy, and exact sampling).

Greedy: follow the child equal to the target argmax while one exists, then add the bonus.
Sampling: at each node draw from the processed target distribution; descend if the draw equals
a child, otherwise emit it and stop. Drafts are deterministic (no draft probabilities), so every
emitted token is an exact sample from the distribution plain decoding would use: lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ngramspec.drafting.tree import DraftTree
from ngramspec.layers.sampler import sample_token
from ngramspec.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyResult:
    accepted_nodes: list[int]  # tree node indices accepted, in path order (root excluded)
    output_ids: list[int]  # accepted draft tokens + the bonus/recovered token


def verify_greedy(tree: DraftTree, targets: list[int]) -> VerifyResult:
    """`targets[i]` is the target argmax after node i."""
    node, nodes, out = 0, [], []
    while True:
        token = targets[node]
        out.append(token)
        child = tree.child_with_token(node, token)
        if child < 0:
            return VerifyResult(nodes, out)
        nodes.append(child)
        node = child


def verify_sampled(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
    output_ids: list[int], generator: torch.Generator | None,
) -> VerifyResult:
    """`logits[i]` are the raw target logits after node i; penalties see the path so far."""
    # logits: [num_nodes, vocab]
    node, nodes, out = 0, [], []
    while True:
        token = sample_token(logits[node], params, prompt_ids, output_ids + out, generator)
        out.append(token)
        child = tree.child_with_token(node, token)
        if child < 0:
            return VerifyResult(nodes, out)
        nodes.append(child)
        node = child
