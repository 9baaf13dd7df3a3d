"""OpenAI's logprobs bodies (chat `choices[].logprobs.content`, completions' token lists) from the
engine's per-token log-probabilities."""

from __future__ import annotations

import math
from typing import Any

from ngramspec.engine.logprobs import TokenLogprob

# OpenAI's stand-in for a log-probability of -inf (JSON has no infinity).
NEG_INF = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else NEG_INF


class TokenText:
    """Each token id's own text (decoded alone), cached: the `token` fields of a logprobs body."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> dict[str, Any]:
    def item(token_id: int, lp: float) -> dict[str, Any]:
        t = text(token_id)
        return {"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, num_top: int,
                        offset: int = 0, first_prompt_id: int | None = None) -> dict[str, Any]:
    """`offset`: characters of text before these tokens (a stream's earlier chunks);
    `first_prompt_id`: echo's first prompt token, listed first with no logprob (nothing precedes
    it)."""
    tokens, offsets, logprobs, tops = [], [], [], []
    if first_prompt_id is not None:
        offsets.append(offset)
        tokens.append(text(first_prompt_id))
        offset += len(tokens[-1])
        logprobs.append(None)
        tops.append(None)
    for e in entries:
        offsets.append(offset)
        tokens.append(text(e.token_id))
        offset += len(tokens[-1])
        logprobs.append(_finite(e.logprob))
        tops.append({text(t): _finite(lp) for t, lp in e.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops if num_top else None,
            "text_offset": offsets}
