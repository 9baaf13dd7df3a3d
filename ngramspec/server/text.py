"""Streaming detokenisation that never takes back text it has sent.

Text is decoded incrementally by the tokenizer's own `DecodeStream` (one Rust call per step),
which holds back a partial UTF-8 character; sent text is further held back by (longest stop
string - 1) characters, since a stop string split across tokens is cut from the final text and
must never have been streamed.
The final text is one full decode cut where the engine found the stop string, exactly what
`ngramspec.outputs.output_text` returns offline. With include_stop_str_in_output the cut is after
the stop string, which the engine found complete in the last token's text, so nothing is held
back for it.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class TextAssembler:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        """`include_stop` (include_stop_str_in_output): the stop string stays in the text, so
        nothing needs holding back for it."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.holdback = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self._text = ""  # decoded so far (may run ahead of what was sent)
        self._sent = 0  # characters sent
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream steps with

    @property
    def sent_text(self) -> str:
        return self._text[: self._sent]

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the text that is now safe to send (maybe "")."""
        self.token_ids += token_ids
        self._text += self._new_text(token_ids)
        return self._advance(len(self._text) - self.holdback)

    def extend(self, token_ids: list[int]) -> None:
        """Add tokens without sending anything (non-streamed responses)."""
        self.token_ids += token_ids

    def finish(self, token_ids: list[int], stop_text_len: int | None) -> str:
        """Add the last tokens; returns the rest of the final text. (Not `push`: that would send
        held-back text the stop string cut may remove.)"""
        self.token_ids += token_ids
        text = self._decode(self.token_ids)
        if stop_text_len is not None:
            text = text[:stop_text_len]
        delta = text[self._sent :]
        self._text, self._sent = text, len(text)
        return delta

    def _new_text(self, token_ids: list[int]) -> str:
        """The text `token_ids` add after the tokens before them, less a partial character."""
        if not token_ids:
            return ""
        return self._stream.step(self._backend, token_ids) or ""

    def _advance(self, end: int) -> str:
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
