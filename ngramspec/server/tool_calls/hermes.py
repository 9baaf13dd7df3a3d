"""Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, used by
SmolLM2, Qwen2/2.5/3, Hermes and others (vLLM's `hermes`)."""

from __future__ import annotations

import json
from typing import Any

from ngramspec.server.tool_calls.base import (
    StateParser,
    ToolCall,
    ToolFormat,
    calls_json_schema,
    cut_at,
    literal,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def format_call(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def format_calls(calls: list[tuple[str, Any]]) -> str:
    return "\n".join(format_call(name, arguments) for name, arguments in calls)


def grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
            special: dict[str, int]) -> str:
    """One call to `name`, or (None: "required") one or more calls to any tool (one if not
    `parallel`). It forces `<tool_call>\\n{"name": "` and the like, which speculation drafts
    for free."""
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    schema = calls_json_schema(tools, name, "arguments")
    open_, close = literal(OPEN, special), literal(CLOSE, special)
    return f'start: call{repeat}\ncall: {open_} "\\n" %json {schema} "\\n" {close}\n'


class HermesParser(StateParser):
    """Text outside `<tool_call>` blocks is content (a possible start of the tag is held back);
    each block is a call once it closes, or at the end if the model stopped inside it. States:
    "outside" and "inside" a block."""

    def __init__(self, tool_names: set[str]) -> None:
        super().__init__(tool_names, "outside")

    def _outside(self, content: list[str], calls: list[ToolCall]) -> bool:
        text, self._buffer, found = cut_at(self._buffer, OPEN)
        content.append(text)
        if found:
            self._state = "inside"
        return found

    def _inside(self, content: list[str], calls: list[ToolCall]) -> bool:
        end = self._buffer.find(CLOSE)
        if end < 0:
            return False
        calls += self._block(self._buffer[:end], content)
        self._buffer, self._state = self._buffer[end + len(CLOSE):], "outside"
        return True

    def _finish(self) -> tuple[str, list[ToolCall]]:
        """An unclosed block is parsed as a call if it can be."""
        rest, self._buffer = self._buffer, ""
        if self._state != "inside":
            return rest, []
        self._state = "outside"
        content: list[str] = []
        calls = self._block(rest, content, unclosed=True)
        return "".join(content), calls

    def _block(self, body: str, content: list[str], unclosed: bool = False) -> list[ToolCall]:
        call = self.make_call(body, ("arguments",))
        if call is not None:
            return [call]
        # not a call we can honour: the text stays content, as the model wrote it
        content.append(OPEN + body + ("" if unclosed else CLOSE))
        return []


FORMAT = ToolFormat("hermes", HermesParser, grammar, SYSTEM, format_calls,
                    markers=(OPEN, CLOSE), template_markers=(OPEN,))
