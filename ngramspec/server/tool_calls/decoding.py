"""Keeping a format's markers in the decoded text. Response text is decoded with
skip_special_tokens (as vLLM's default), which drops a marker the tokenizer holds as a special
token (Mistral's `[TOOL_CALLS]`, Llama 3's `<|python_tag|>`): the parser would never see it."""

from __future__ import annotations

from typing import Any

from ngramspec.server.text import TextAssembler


def special_markers(tokenizer: Any, markers: tuple[str, ...]) -> dict[str, int]:
    """The markers that are one special token of `tokenizer`, with their ids."""
    out = {}
    for marker in markers:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == marker \
                and tokenizer.decode([token_id], skip_special_tokens=True) == "":
            out[marker] = token_id
    return out


class MarkerText(TextAssembler):
    """TextAssembler whose text keeps the tokens `keep` (id -> text): the tokens between them
    decode as before (special tokens skipped), each kept token as its text."""

    def __init__(self, base: TextAssembler, keep: dict[int, str]) -> None:
        # `base`'s settings (stop strings, options), whatever the request gave it; it has
        # decoded nothing yet
        vars(self).update(vars(base))
        self.keep = keep
        self._prefix = 0  # decode window: token_ids[_prefix:_read] is already in the text
        self._read = 0

    def finish(self, token_ids: list[int], stop_text_len: int | None) -> str:
        if stop_text_len is not None:  # the engine's cut is in text without the kept tokens
            stop_text_len = self._kept_offset(self.token_ids + token_ids, stop_text_len)
        return super().finish(token_ids, stop_text_len)

    def _new_text(self, token_ids: list[int]) -> str:
        # A window decode through `_decode`, not the base's DecodeStream, which would drop the
        # kept tokens. `push` has already appended `token_ids`.
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        parts, start = [], 0
        for i, token_id in enumerate(token_ids):
            if token_id in self.keep:
                parts += [super()._decode(token_ids[start:i]), self.keep[token_id]]
                start = i + 1
        parts.append(super()._decode(token_ids[start:]))
        return "".join(parts)

    def _kept_offset(self, token_ids: list[int], cut: int) -> int:
        """`cut`, an offset into the plain decoding of `token_ids`, as an offset into ours. A
        cut at a kept token falls after it (the stop string starts after its text)."""
        plain = TextAssembler._decode  # the base decoding, special tokens skipped
        out, start = 0, 0
        ends = [i for i, t in enumerate(token_ids) if t in self.keep] + [len(token_ids)]
        for end in ends:
            segment = len(plain(self, token_ids[start:end]))
            plain_end = len(plain(self, token_ids[:end]))
            if cut < plain_end or end == len(token_ids):
                # counted back from the segment's end: decoding a segment alone may lose a
                # leading space the whole decoding keeps, never anything at its end
                return out + max(0, segment - (plain_end - cut))
            out += segment + len(self.keep[token_ids[end]])
            start = end + 1
        return out
