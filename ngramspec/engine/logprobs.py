"""Log-probabilities of the tokens a step emits, and of the most likely alternatives.

A speculative step emits several tokens from one verify pass: token i of the step was drawn from
the logits after node path[i] of the tree (path = root, then the accepted nodes), the same row
plain decoding would have computed for that position, so logprobs with speculation equal plain
decoding's. Two modes, vLLM's names: `raw_logprobs` (log-softmax of the model's logits) and
`processed_logprobs` (of the distribution the token is drawn from: logit_bias, min_tokens,
allowed_token_ids, bad_words and penalties, then temperature, top-k, top-p and min-p; tokens
those rule out get -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ngramspec.layers.sampler import process_logits, target_probs
from ngramspec.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `params.logprobs` most likely (token, logprob)


def _log_distribution(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                      output_ids: list[int]) -> torch.Tensor:
    # logits: [V] -> log-probabilities [V]
    logits = logits.float()
    if params.logprobs_mode == "raw_logprobs":
        return torch.log_softmax(logits, dim=-1)
    logits = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:  # no temperature: the argmax of the processed logits is what is emitted
        return torch.log_softmax(logits, dim=-1)
    return torch.log(target_probs(logits, params))


def step_logprobs(logits: torch.Tensor, path: list[int], tokens: list[int],
                  params: SamplingParams, prompt_ids: list[int],
                  output_ids: list[int]) -> list[TokenLogprob]:
    """One entry per emitted token: tokens[i] from logits[path[i]], after `output_ids`."""
    # logits: [tree nodes, V]
    out = []
    for i, token in enumerate(tokens):
        lp = _log_distribution(logits[path[i]], params, prompt_ids, output_ids + tokens[:i])
        top: tuple[tuple[int, float], ...] = ()
        if params.logprobs:
            values, ids = torch.topk(lp, min(params.logprobs, lp.shape[0]))
            top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprob(token, float(lp[token]), top))
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Raw logprobs of prompt tokens: next_ids[i] under logits[i] (the row of the token before)."""
    # logits: [n, V]
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(next_ids, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    tops = torch.topk(lp, min(k, lp.shape[1])) if k else None
    return [TokenLogprob(t, float(picked[i]),
                         tuple(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops else ())
            for i, t in enumerate(next_ids)]
