"""Llama 3.1/3.2's JSON tool calls (vLLM's `llama3_json`): the reply is one or more
`{"name": ..., "parameters": {...}}` objects separated by `;`, possibly after
`<|python_tag|>`. Calls are recognised where a reply starts with `{` or wherever the tag
appears (`"arguments"` is taken for `"parameters"`, as vLLM does)."""

from __future__ import annotations

import json
from typing import Any

from ngramspec.server.tool_calls.base import (
    JsonSpan,
    StateParser,
    ToolCall,
    ToolFormat,
    calls_json_schema,
    cut_at,
)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")

SYSTEM = (
    "You have access to the following functions:\n\n{tools}\n\n"
    "To call a function, reply with only a JSON object in the format "
    '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
    'To call several, separate the objects with "; ". Do not use variables.'
)


def format_calls(calls: list[tuple[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": name, "parameters": arguments})
                     for name, arguments in calls)


def grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
            special: dict[str, int]) -> str:
    """One call to `name`, or (None: "required") one or more calls to any tool (one if not
    `parallel`), as plain JSON (the tag marks Llama's built-in tools, not JSON calls)."""
    repeat = ' ("; " call)*' if parallel and name is None else ""
    return (f"start: call{repeat}\n"
            f"call: %json {calls_json_schema(tools, name, 'parameters')}\n")


class Llama3JsonParser(StateParser):
    """States: "start" (only whitespace so far), "content", "calls" (a call's `{` expected
    next), "after" (a call just closed: `;` and whitespace, then another call or content)."""

    def __init__(self, tool_names: set[str]) -> None:
        super().__init__(tool_names, "start")
        self._lead = ""  # consumed text (tag, whitespace) that is content unless a call follows
        self._span = JsonSpan()

    def _finish(self) -> tuple[str, list[ToolCall]]:
        rest = "" if self._state == "after" else self._lead + self._buffer  # separators go
        self._buffer, self._lead, self._state = "", "", "content"
        return rest, []

    def _start(self, content: list[str], calls: list[ToolCall]) -> bool:
        text = self._buffer.lstrip()
        if not text or (PYTHON_TAG.startswith(text) and text != PYTHON_TAG):
            return False
        if text.startswith(PYTHON_TAG):
            cut = len(self._buffer) - len(text) + len(PYTHON_TAG)
            self._lead, self._buffer = self._buffer[:cut], self._buffer[cut:]
            self._state = "calls"
        else:
            self._state = "calls" if text[0] == "{" else "content"
        return True

    def _content(self, content: list[str], calls: list[ToolCall]) -> bool:
        text, self._buffer, found = cut_at(self._buffer, PYTHON_TAG)
        content.append(text)
        if found:
            self._lead, self._state = PYTHON_TAG, "calls"
        return found

    def _calls(self, content: list[str], calls: list[ToolCall]) -> bool:
        text = self._buffer.lstrip()
        if not text:
            return False
        self._lead += self._buffer[: len(self._buffer) - len(text)]
        self._buffer = text
        if text[0] != "{":
            return self._give_up(content, 0)
        end = self._span.end(text)
        if end is None:
            return False
        call = self.make_call(text[:end], ARGUMENT_KEYS)
        if call is None:
            return self._give_up(content, end)
        calls.append(call)
        self._lead, self._buffer, self._state = "", text[end:], "after"
        return True

    def _after(self, content: list[str], calls: list[ToolCall]) -> bool:
        text = self._buffer.lstrip("; \t\r\n")
        if not text:
            return False
        if text[0] == "{":
            self._buffer, self._state = text, "calls"
        else:  # the separators and what follows are content
            self._state = "content"
        return True

    def _give_up(self, content: list[str], end: int) -> bool:
        """Not a call: what led here and the first `end` characters are content."""
        content.append(self._lead + self._buffer[:end])
        self._lead, self._buffer, self._state = "", self._buffer[end:], "content"
        self._span.reset()
        return True


FORMAT = ToolFormat("llama3_json", Llama3JsonParser, grammar, SYSTEM, format_calls,
                    markers=(PYTHON_TAG,), template_markers=(PYTHON_TAG, '"parameters"'))
