"""Tool calls in the formats vLLM's `--tool-call-parser` names: `hermes` (`<tool_call>` blocks),
`llama3_json` (Llama 3.1/3.2's JSON objects) and `mistral` (`[TOOL_CALLS]` and a JSON list).

Each format (one module each) gives:
- a parser: finds the calls in the generated text, streamed or whole, and keeps everything else
  as content;
- a grammar for `tool_choice` "required" or a named function: a Lark grammar over the format,
  each call's JSON constrained to its function's schema (llguidance's `%json`);
- our rendering of `tools` and of earlier calls, for chat templates that do not know tools
  (`render_messages`); a template that does renders them itself.

The format is `ServerSettings.tool_call_parser` if set, else chosen from the chat template
(`select_format`); `ChatTools` is one request's setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ngramspec.server.text import TextAssembler
from ngramspec.server.tool_calls import hermes, llama3_json, mistral
from ngramspec.server.tool_calls.base import ToolCall, ToolCallParser, ToolFormat
from ngramspec.server.tool_calls.decoding import MarkerText, special_markers
from ngramspec.server.tool_calls.render import render_messages, template_knows_tools

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (hermes.FORMAT, llama3_json.FORMAT,
                                                      mistral.FORMAT)}
TOOL_CALL_PARSERS = tuple(FORMATS)

# Template markers are tried in this order: Hermes templates may also mention "parameters".
_DETECTION_ORDER = (hermes.FORMAT, mistral.FORMAT, llama3_json.FORMAT)

__all__ = ["FORMATS", "TOOL_CALL_PARSERS", "ChatTools", "MarkerText", "ToolCall",
           "ToolCallParser", "ToolFormat", "chat_tools", "render_messages", "select_format",
           "special_markers", "template_knows_tools", "tool_call_grammar"]


def select_format(parser: str | None, chat_template: str | None) -> ToolFormat:
    """The named format, or the one whose markers the chat template writes (Hermes if none)."""
    if parser is not None:
        if parser not in FORMATS:
            raise ValueError(f"unknown tool call parser {parser!r}; choose one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        return FORMATS[parser]
    for fmt in _DETECTION_ORDER:
        if chat_template and any(m in chat_template for m in fmt.template_markers):
            return fmt
    return hermes.FORMAT


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                      fmt: ToolFormat = hermes.FORMAT,
                      special: dict[str, int] | None = None) -> str:
    """Lark grammar: one call to `name`, or (name None: "required") one or more calls to any
    tool (one if not `parallel`), in `fmt`; `special`: its markers that are special tokens."""
    return fmt.grammar(tools, name, parallel, special or {})


@dataclass(frozen=True, slots=True)
class ChatTools:
    """One chat request's tools: the format, the tools' names (a call to anything else stays
    content), and the format's markers that are special tokens of the tokenizer."""

    format: ToolFormat
    names: frozenset[str]
    special: dict[str, int]

    def parser(self) -> ToolCallParser:
        return self.format.parser(set(self.names))

    def grammar(self, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
        return self.format.grammar(tools, name, parallel, self.special)

    def text(self, base: TextAssembler) -> TextAssembler:
        """The response's detokeniser `base`, made to keep the special-token markers the parser
        reads (`base` itself where it keeps special tokens anyway)."""
        if not self.special or not getattr(base, "skip_special_tokens", True):
            return base
        return MarkerText(base, {i: m for m, i in self.special.items()})


def chat_tools(fmt: ToolFormat, tools: list[dict[str, Any]], tokenizer: Any) -> ChatTools:
    return ChatTools(fmt, frozenset(t["function"]["name"] for t in tools),
                     special_markers(tokenizer, fmt.markers))
