"""Stop conditions, checked after every appended token so speculation stops exactly where plain
decoding would.

min_tokens (vLLM's rule): the first min_tokens output tokens never end the request. EOS and stop
token ids cannot be sampled there (layers.sampler masks them), and a stop string counts only if it
ends after their text, so it is looked for once the output is longer than min_tokens.
"""

from __future__ import annotations

from ngramspec.engine.sequence import Sequence

# Characters of slack at the start of a decoded tail: decoding only a suffix of the tokens can
# differ from the whole text's end there (a split UTF-8 character, a SentencePiece leading space,
# a cleanup rule joining two tokens), never further in.
TAIL_SLACK = 16


def check_stop(seq: Sequence, tokenizer, max_model_len: int) -> str | None:
    params, token = seq.params, seq.token_ids[-1]
    if seq.num_output_tokens > params.min_tokens:
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and _stop_string(seq, tokenizer):
            return "stop"
    if seq.num_output_tokens >= params.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None


def _stop_string(seq: Sequence, tokenizer) -> bool:
    """Whether a stop string now ends the text; sets seq.stop_text_len, where the text is cut
    (before the stop string, or after it with include_stop_str_in_output)."""
    params = seq.params
    skip = params.skip_special_tokens
    # Only the tail can hold a new match: the last token added at most its own text.
    window = max(len(s) for s in params.stop) + 16
    if _first_hit(_tail_text(seq, tokenizer, window + TAIL_SLACK, skip), params.stop,
                  window) is None:
        return False
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=skip)
    floor = 0  # a match must end after this many characters (the first min_tokens' text)
    if params.min_tokens:
        floor = len(tokenizer.decode(seq.output_ids[: params.min_tokens],
                                     skip_special_tokens=skip))
    hit = _first_hit(text, params.stop, window, floor)
    if hit is None:
        return False
    start, stop = hit
    seq.stop_text_len = start + len(stop) if params.include_stop_str_in_output else start
    return True


def _first_hit(text: str, stops: list[str], window: int,
               floor: int = 0) -> tuple[int, str] | None:
    """The earliest stop string (the first listed, on a tie) in the last `window` characters of
    `text` that ends after `floor` characters: (where it starts, which)."""
    start = max(0, len(text) - window)
    hits = ((i, n, s) for n, s in enumerate(stops)
            if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0)
    best = min(hits, default=None)
    return None if best is None else (best[0], best[2])


def _tail_text(seq: Sequence, tokenizer, need: int, skip_special_tokens: bool) -> str:
    """The decoded text of the output's last tokens, grown until it has `need` characters or is
    the whole output. Its last need - TAIL_SLACK characters are the whole text's; the caller
    decodes the whole output only on a hit, to place the cut. Decoding the whole output on every
    token cost O(length) each (224 µs at 600 tokens), more than a GPU step at batch 64."""
    ids, first = seq.token_ids, seq.num_prompt_tokens
    count = need
    while True:
        lo = max(first, len(ids) - count)
        tail = tokenizer.decode(ids[lo:], skip_special_tokens=skip_special_tokens)
        if len(tail) >= need or lo == first:
            return tail
        count *= 2
