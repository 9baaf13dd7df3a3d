"""Incremental detokenisation for printing tokens as they come."""

from __future__ import annotations

from typing import TextIO


class TextStreamer:
    """Prints the new text of one request; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = 0

    def on_tokens(self, request_id: str, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def finish(self, final_text: str) -> None:
        # The final text may be shorter (a stop string cut it) or hold a held-back character.
        if len(final_text) > self.printed:
            self.out.write(final_text[self.printed :])
        self.out.write("\n")
        self.out.flush()
