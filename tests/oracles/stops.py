"""The stop-string check as first written: the whole output decoded on every token (the reference
for engine/stops.py, which decodes a tail and the whole output only on a hit)."""

from __future__ import annotations


def reference_stop_text_len(output_ids: list[int], tokenizer, stops: list[str]) -> int | None:
    """Where the output's text is cut when its last token completed a stop string, else None."""
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    window = max(len(s) for s in stops) + 16
    start = max(0, len(text) - window)
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None
