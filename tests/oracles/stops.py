"""The stop-string check as first written: the whole output decoded on every token (the reference
for engine/stops.py, which decodes a tail and the whole output only on a hit)."""

from __future__ import annotations


def reference_stop_text_len(output_ids: list[int], tokenizer, stops: list[str],
                            min_tokens: int = 0, include: bool = False,
                            skip_special_tokens: bool = True) -> int | None:
    """Where the output's text is cut when its last token completed a stop string, else None.
    min_tokens: no stop before the output is longer, and a match must end after the text of
    the first min_tokens tokens; include: the cut is after the stop string (the earliest match,
    the first listed on a tie)."""
    if len(output_ids) <= min_tokens:
        return None
    text = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    floor = len(tokenizer.decode(output_ids[:min_tokens],
                                 skip_special_tokens=skip_special_tokens)) if min_tokens else 0
    window = max(len(s) for s in stops) + 16
    start = max(0, len(text) - window)
    for i in range(start, len(text)):  # every position, every stop string
        for s in stops:
            if text.startswith(s, i) and i + len(s) > floor:
                return i + len(s) if include else i
    return None
