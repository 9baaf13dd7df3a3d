"""OpenAI messages (assistant `tool_calls`, `tool` results) and `tools` as a chat template sees
them. A template that knows tools gets them as they are (the caller passes `tools=` to it); one
that does not (SmolLM2's) gets the format's system prompt listing the tools, the assistant's
calls written in the format, and `<tool_response>` user turns for the results."""

from __future__ import annotations

import json
from typing import Any

from ngramspec.server.tool_calls import hermes
from ngramspec.server.tool_calls.base import ToolFormat


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    knows_tools: bool, fmt: ToolFormat = hermes.FORMAT) -> list[dict[str, Any]]:
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
            calls = fmt.format_calls([(c["function"]["name"],
                                       _arguments(c["function"]["arguments"]))
                                      for c in m["tool_calls"]])
            content = "\n".join(([m["content"]] if m.get("content") else []) + [calls])
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        system = fmt.system_prompt.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _arguments(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _with_parsed_arguments(m: dict[str, Any]) -> dict[str, Any]:
    """Templates write an earlier call's arguments with `tojson`: they need the object."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"],
                                "arguments": _arguments(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}
