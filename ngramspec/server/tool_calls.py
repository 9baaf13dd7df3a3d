"""Tool calls in the Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
used by SmolLM2, Qwen2/2.5/3, Hermes and others.

- `render_messages`: OpenAI messages (assistant `tool_calls`, `tool` results) and `tools` as the
  chat template sees them. A template that knows tools gets them as they are; one that does not
  (SmolLM2's) gets the Hermes system prompt, `<tool_call>` blocks and `<tool_response>` turns.
- `tool_call_grammar`: `tool_choice` "required" or a named function as a Lark grammar over the
  same format, each call's JSON constrained to its function's schema (llguidance's `%json`).
  The grammar forces `<tool_call>\\n{"name": "` and the like, which speculation drafts for free.
- `ToolCallParser`: finds the calls in the generated text, streamed or whole, and keeps
  everything else as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ngramspec.structured.grammar import JSON_ONE_LINE

OPEN, CLOSE = "<tool_call>", "</tool_call>"

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    knows_tools: bool) -> list[dict[str, Any]]:
    """`messages` (OpenAI form, arguments as JSON text) for a chat template; with
    `knows_tools` the template renders tools itself (pass them as `tools=`)."""
    if knows_tools:
        return [_with_parsed_arguments(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [format_call(c["function"]["name"], _arguments(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def format_call(name: str, arguments: Any) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def _arguments(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _with_parsed_arguments(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """Lark grammar: one call to `name`, or (name None: "required") one or more calls to any
    tool (one if not `parallel`)."""
    chosen = [t for t in tools if t["function"]["name"] == name] if name else tools
    schema = {"anyOf": [_call_schema(t["function"]) for t in chosen]} if len(chosen) > 1 \
        else _call_schema(chosen[0]["function"])
    schema["x-guidance"] = JSON_ONE_LINE  # the layout of the call's JSON, as in response_format
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    return (f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n')


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "additionalProperties": False,
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"]}


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives: text outside
    `<tool_call>` blocks is content (a possible start of the tag is held back), each block is
    a call once it closes (or at the end, if the model stopped inside it)."""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = tool_names
        self._buffer = ""
        self._inside = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content text and the calls completed by `text`."""
        self._buffer += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                calls += self._call(self._buffer[:end], content)
                self._buffer, self._inside = self._buffer[end + len(CLOSE):], False
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:start])
            self._buffer, self._inside = self._buffer[start + len(OPEN):], True
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unclosed block is parsed as a call if it can be."""
        rest, self._buffer = self._buffer, ""
        if not self._inside:
            return rest, []
        self._inside = False
        content: list[str] = []
        calls = self._call(rest, content, unclosed=True)
        self.calls += calls
        return "".join(content), calls

    def _call(self, body: str, content: list[str], unclosed: bool = False) -> list[ToolCall]:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if (isinstance(obj, dict) and obj.get("name") in self.tool_names
                and isinstance(obj.get("arguments", {}), dict)):
            return [ToolCall(obj["name"], json.dumps(obj.get("arguments", {}),
                                                     ensure_ascii=False))]
        # not a call we can honour: the text stays content, as the model wrote it
        content.append(OPEN + body + ("" if unclosed else CLOSE))
        return []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
