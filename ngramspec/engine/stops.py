"""Stop conditions, checked after every appended token so speculation stops exactly where plain
decoding would."""

from __future__ import annotations

from ngramspec.engine.sequence import Sequence


def check_stop(seq: Sequence, tokenizer, max_model_len: int) -> str | None:
    params, token = seq.params, seq.token_ids[-1]
    if not params.ignore_eos and token in seq.eos_token_ids:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.stop:
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        # Only the tail can hold a new match: the last token added at most its own text.
        window = max(len(s) for s in params.stop) + 16
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
