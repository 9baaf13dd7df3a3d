"""Logit processing and sampling for one row at a time (penalties, min_tokens and bad_words
depend on each row's history)."""

from __future__ import annotations

import torch

from ngramspec.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """vLLM semantics: repetition over prompt + output, presence/frequency over output only."""
    # logits: [V] float32
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    vocab = logits.shape[0]
    if params.repetition_penalty != 1:
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab].unique()
        vals = logits[seen]
        r = params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / r, vals * r)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        out = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Everything before temperature, in vLLM's order: allowed_token_ids, then bad_words, then
    min_tokens and logit_bias, then the penalties. `output_ids`: the output before this row."""
    # logits: [V]
    if not params.processes_logits:
        return logits
    vocab = logits.shape[0]
    if params.allowed_token_ids is not None:
        keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long,
                            device=logits.device)
        logits = torch.full_like(logits, float("-inf")).index_copy(0, keep, logits[keep])
    banned = [t for t in banned_tokens(params, output_ids) if t < vocab]
    if banned:
        logits = logits.index_fill(
            0, torch.tensor(banned, dtype=torch.long, device=logits.device), float("-inf"))
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype,
                            device=logits.device)
        logits = logits.index_add(0, torch.tensor(ids, dtype=torch.long, device=logits.device),
                                  bias)
    return apply_penalties(logits, params, prompt_ids, output_ids)


def banned_tokens(params: SamplingParams, output_ids: list[int]) -> list[int]:
    """Tokens that may not come next: the stop tokens while the output is shorter than
    min_tokens, and the last token of each bad word whose other tokens end the output (vLLM
    matches bad words against the output only, not the prompt)."""
    banned = list(params.all_stop_token_ids) if len(output_ids) < params.min_tokens else []
    for word in params.bad_words_token_ids:
        head = len(word) - 1
        if head <= len(output_ids) and (head == 0 or tuple(output_ids[-head:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def _support(logits: torch.Tensor, params: SamplingParams
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens plain decoding can draw and their probabilities: temperature, top-k, top-p,
    min-p. With top-k the rest is computed on the k survivors only (ties at the k-th value
    stay): a sort and a draw over the whole vocabulary would dominate the token's cost."""
    # logits: [V] (penalties already applied) -> (ids [S] or None for all V, probs [S])
    logits = logits / params.temperature
    ids = None
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        ids = (logits >= kth).nonzero().squeeze(1)
        logits = logits[ids]
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        kept, probs = _nucleus(probs, params.top_p)
        ids = kept if ids is None else ids[kept]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return ids, probs / probs.sum()


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of the tokens by probability (equal ones in index order) whose mass
    reaches top_p, the crossing token included: (their indices, their probabilities). Looked
    for among the largest few, then more, rather than sorting the whole vocabulary."""
    # probs: [S] -> ([K], [K])
    n = probs.shape[0]
    k = min(64, n)
    while True:
        kth = torch.topk(probs, k).values[-1]
        candidates = (probs >= kth).nonzero().squeeze(1)  # ties with the k-th included
        top, order = torch.sort(probs[candidates], descending=True, stable=True)
        cum = top.cumsum(0)
        if candidates.shape[0] == n or float(cum[-1]) >= top_p:
            break
        k = min(4 * k, n)
    keep = cum - top < top_p
    # The most likely token always stays: a top_p below float32's range (1e-72) compares as 0.
    keep[0] = True
    return candidates[order[keep]], top[keep]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain decoding samples from, over the whole vocabulary."""
    # logits: [V] (penalties already applied) -> probs [V]
    ids, probs = _support(logits, params)
    if ids is None:
        return probs
    return torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).index_put_(
        (ids,), probs)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
    generator: torch.Generator | None,
) -> int:
    """One token from one row of logits, exactly as plain decoding would draw it: one uniform
    from `generator` per token, inverted through the support's cumulative probabilities."""
    logits = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return argmax_rows(logits[None])[0]
    ids, probs = _support(logits, params)
    cdf = probs.double().cumsum(0)
    device = generator.device if generator is not None else torch.device("cpu")
    u = float(torch.rand((), dtype=torch.float64, generator=generator, device=device))
    point = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    # right=True: a zero-probability token (a flat step of the cdf) is never the answer.
    i = int(torch.searchsorted(cdf, point, right=True)[0])
    if i >= cdf.shape[0]:  # u * total rounded up to the total: the last token that can be drawn
        i = int((probs > 0).nonzero()[-1, 0])
    return i if ids is None else int(ids[i])


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, the first of equal maxima (a NaN counts as the maximum), as torch's.
    float32 rows on the CPU go through numpy: torch's CPU argmax took 0.38 ms for a 12-node
    tree's rows of SmolLM2's 49,152 logits on the 2-core CPU, numpy's 0.05 ms."""
    # logits: [rows, vocab]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()
