"""Mistral's tool calls (vLLM's `mistral`, Mistral 7B Instruct v0.3 and its template):
`[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}, ...]`. Mistral's templates
take back only 9-character alphanumeric call ids, so the calls get ids of that form."""

from __future__ import annotations

import json
import random
import string
from typing import Any

from ngramspec.server.tool_calls.base import (
    JsonSpan,
    StateParser,
    ToolCall,
    ToolFormat,
    calls_json_schema,
    cut_at,
    literal,
)

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits

SYSTEM = (
    "You can call the following functions:\n{tools}\n\n"
    f"To call functions, reply with {TOOL_CALLS} followed by a JSON list of the calls: "
    f'{TOOL_CALLS} [{{{{"name": <function-name>, "arguments": <args-dict>}}}}]'
)


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


def format_calls(calls: list[tuple[str, Any]]) -> str:
    return f"{TOOL_CALLS} " + json.dumps([{"name": name, "arguments": arguments}
                                          for name, arguments in calls])


def grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
            special: dict[str, int]) -> str:
    """`[TOOL_CALLS] [` and one call to `name`, or (None: "required") one or more calls to any
    tool (one if not `parallel`), then `]`."""
    repeat = ' (", " call)*' if parallel and name is None else ""
    return (f'start: {literal(TOOL_CALLS, special)} " [" call{repeat} "]"\n'
            f"call: %json {calls_json_schema(tools, name, 'arguments')}\n")


class MistralParser(StateParser):
    """States: "content" (text until `[TOOL_CALLS]`, a possible start of it held back),
    "open" (the list's `[` expected), "item" (a call's `{` expected), "sep" (`,` or `]`).
    Calls are taken as each object closes; whatever breaks the list is content from there."""

    def __init__(self, tool_names: set[str]) -> None:
        super().__init__(tool_names, "content", mistral_call_id)
        self._lead = ""  # consumed marker, brackets, commas: content unless a call follows
        self._span = JsonSpan()

    def _finish(self) -> tuple[str, list[ToolCall]]:
        rest = self._lead + self._buffer
        self._buffer, self._lead, self._state = "", "", "content"
        self._span.reset()
        return rest, []

    def _content(self, content: list[str], calls: list[ToolCall]) -> bool:
        text, self._buffer, found = cut_at(self._buffer, TOOL_CALLS)
        content.append(text)
        if found:
            self._lead, self._state = TOOL_CALLS, "open"
        return found

    def _open(self, content: list[str], calls: list[ToolCall]) -> bool:
        return self._expect("[", "item", content)

    def _sep(self, content: list[str], calls: list[ToolCall]) -> bool:
        if self._buffer.lstrip()[:1] == "]":
            self._buffer = self._buffer.lstrip()[1:]
            self._lead, self._state = "", "content"
            return True
        return self._expect(",", "item", content)

    def _item(self, content: list[str], calls: list[ToolCall]) -> bool:
        if not self._skip_space():
            return False
        if self._buffer[0] != "{":
            return self._give_up(content, 0)
        end = self._span.end(self._buffer)
        if end is None:
            return False
        call = self.make_call(self._buffer[:end], ("arguments",))
        if call is None:
            return self._give_up(content, end)
        calls.append(call)
        self._lead, self._buffer, self._state = "", self._buffer[end:], "sep"
        return True

    def _expect(self, char: str, state: str, content: list[str]) -> bool:
        if not self._skip_space():
            return False
        if self._buffer[0] != char:
            return self._give_up(content, 0)
        self._lead, self._buffer, self._state = self._lead + char, self._buffer[1:], state
        return True

    def _skip_space(self) -> bool:
        """Leading whitespace into the lead; False if nothing else has come yet."""
        text = self._buffer.lstrip()
        self._lead += self._buffer[: len(self._buffer) - len(text)]
        self._buffer = text
        return bool(text)

    def _give_up(self, content: list[str], end: int) -> bool:
        """Not (the rest of) a call list: what led here and the first `end` characters are
        content, and the text after them is read as content again."""
        content.append(self._lead + self._buffer[:end])
        self._lead, self._buffer, self._state = "", self._buffer[end:], "content"
        self._span.reset()
        return True


FORMAT = ToolFormat("mistral", MistralParser, grammar, SYSTEM, format_calls,
                    markers=(TOOL_CALLS,), template_markers=(TOOL_CALLS,))
