"""Stop conditions, checked after every appended token so speculation stops exactly where plain
decoding would."""

from __future__ import annotations

from ngramspec.engine.sequence import Sequence

# Characters of slack at the start of a decoded tail: decoding only a suffix of the tokens can
# differ from the whole text's end there (a split UTF-8 character, a SentencePiece leading space,
# a cleanup rule joining two tokens), never further in.
TAIL_SLACK = 16


def check_stop(seq: Sequence, tokenizer, max_model_len: int) -> str | None:
    params, token = seq.params, seq.token_ids[-1]
    if not params.ignore_eos and token in seq.eos_token_ids:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.stop:
        # Only the tail can hold a new match: the last token added at most its own text.
        window = max(len(s) for s in params.stop) + 16
        if _tail_may_match(seq.output_ids, tokenizer, params.stop, window):
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            start = max(0, len(text) - window)
            hits = [i for s in params.stop if (i := text.find(s, start)) >= 0]
            if hits:
                seq.stop_text_len = min(hits)
                return "stop"
    if seq.num_output_tokens >= params.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None


def _tail_may_match(output_ids: list[int], tokenizer, stops: list[str], window: int) -> bool:
    """Whether a stop string occurs in the last `window` characters of the output's text, read
    from a decoded suffix of the tokens with TAIL_SLACK characters to spare (grown until it has
    them or is the whole output). Decoding the whole output on every token cost O(length) each,
    ~120 µs at 600 tokens, which at batch 64 with stop strings was more than a GPU step; the
    caller decodes it all only on a hit, to place the cut exactly."""
    need = window + TAIL_SLACK
    count = need
    while True:
        tail = tokenizer.decode(output_ids[-count:], skip_special_tokens=True)
        if len(tail) >= need or count >= len(output_ids):
            break
        count *= 2
    start = max(0, len(tail) - window)
    return any(tail.find(s, start) >= 0 for s in stops)
