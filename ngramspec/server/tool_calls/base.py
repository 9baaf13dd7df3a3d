"""What the tool-call formats share: the call, the parser contract, JSON scanning, call schemas
and the format record each format module fills in."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ngramspec.structured.grammar import JSON_ONE_LINE


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or openai_call_id()

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives. Formats decide only on
    text they hold whole (a call once its JSON closes, content once it cannot start a call), so
    any chunking of the same text gives the same content and calls as the whole text at once."""

    def __init__(self, tool_names: set[str], new_id: Callable[[], str] = openai_call_id) -> None:
        self.tool_names = tool_names
        self.new_id = new_id
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content text and the calls completed by `text`."""
        content, calls = self._push(text)
        self.calls += calls
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end (text held back in case it started a call)."""
        content, calls = self._finish()
        self.calls += calls
        return content, calls

    def _push(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def _finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def make_call(self, text: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
        """`text` as a call to one of the tools (`{"name": ..., <key>: {...}}`, the first of
        `argument_keys` present; none: no arguments), or None if it is not one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                or obj["name"] not in self.tool_names:
            return None
        arguments = next((obj[k] for k in argument_keys if k in obj), {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), self.new_id())


class StateParser(ToolCallParser):
    """A parser whose `_<state>(content, calls)` methods each make one move on `_buffer` and
    return False when they need more text."""

    def __init__(self, tool_names: set[str], state: str,
                 new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._buffer = ""
        self._state = state

    def _push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while getattr(self, f"_{self._state}")(content, calls):
            pass
        return "".join(content), calls


class JsonSpan:
    """Where the JSON object or array that opens a buffer closes. Resumable: a long call arrives
    in many pieces and each look scans only the new text. Only brackets outside strings count;
    json.loads judges the rest."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pos, self._depth, self._in_string, self._escaped = 0, 0, False, False

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is incomplete."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.reset()
                    return i + 1
        self._pos = len(text)
        return None


def cut_at(text: str, tag: str) -> tuple[str, str, bool]:
    """(content, rest, found): with `tag` in `text`, what comes before and after its first
    occurrence; without, all but a suffix that may start `tag` (held back in `rest`)."""
    at = text.find(tag)
    if at < 0:
        keep = len(text) - partial_suffix(text, tag)
        return text[:keep], text[keep:], False
    return text[:at], text[at + len(tag):], True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """One call's JSON: `{"name": <this function>, <arguments_key>: <its parameters>}`."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "additionalProperties": False,
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key]}


def calls_json_schema(tools: list[dict[str, Any]], name: str | None,
                      arguments_key: str) -> str:
    """The `%json` schema of one call: to `name`, or (None) to any of `tools`, laid out as
    response_format lays out JSON."""
    chosen = [t for t in tools if t["function"]["name"] == name] if name else tools
    schema = {"anyOf": [call_schema(t["function"], arguments_key) for t in chosen]} \
        if len(chosen) > 1 else call_schema(chosen[0]["function"], arguments_key)
    schema["x-guidance"] = JSON_ONE_LINE
    return json.dumps(schema)


def literal(text: str, special: dict[str, int]) -> str:
    """A Lark terminal for `text`: the token itself where the tokenizer holds it as one special
    token (a quoted string would force its spelling in ordinary tokens instead)."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


# (tools, name or None, parallel, special markers) -> Lark grammar
GrammarFn = Callable[[list[dict[str, Any]], str | None, bool, dict[str, int]], str]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One tool-call format, named as vLLM's --tool-call-parser names it."""

    name: str
    parser: Callable[[set[str]], ToolCallParser]
    grammar: GrammarFn  # tool_choice "required" / named, in this format
    system_prompt: str  # our rendering of `tools` ({tools}: one JSON per line) ...
    format_calls: Callable[[list[tuple[str, Any]]], str]  # ... and of an assistant's calls
    markers: tuple[str, ...]  # text the parser reads that tokenizers may hold as special tokens
    template_markers: tuple[str, ...]  # text in a chat template that means this format
