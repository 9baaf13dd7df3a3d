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
        if _first_hit(_tail_text(seq, tokenizer, window + TAIL_SLACK), params.stop,
                      window) is not None:
            text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            hit = _first_hit(text, params.stop, window)
            if hit is not None:
                seq.stop_text_len = hit
                return "stop"
    if seq.num_output_tokens >= params.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None


def _first_hit(text: str, stops: list[str], window: int) -> int | None:
    """Where the earliest stop string starts in the last `window` characters of `text`."""
    start = max(0, len(text) - window)
    return min((i for s in stops if (i := text.find(s, start)) >= 0), default=None)


def _tail_text(seq: Sequence, tokenizer, need: int) -> str:
    """The decoded text of the output's last tokens, grown until it has `need` characters or is
    the whole output. Its last need - TAIL_SLACK characters are the whole text's; the caller
    decodes the whole output only on a hit, to place the cut. Decoding the whole output on every
    token cost O(length) each (224 µs at 600 tokens), more than a GPU step at batch 64."""
    ids, first = seq.token_ids, seq.num_prompt_tokens
    count = need
    while True:
        lo = max(first, len(ids) - count)
        tail = tokenizer.decode(ids[lo:], skip_special_tokens=True)
        if len(tail) >= need or lo == first:
            return tail
        count *= 2
