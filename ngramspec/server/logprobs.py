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
                        offset: int = 0) -> dict[str, Any]:
    """`offset`: characters of output text before these tokens (a stream's earlier chunks)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(text(e.token_id))
        offset += len(tokens[-1])
    top = [{text(t): _finite(lp) for t, lp in e.top} for e in entries] if num_top else None
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets}
