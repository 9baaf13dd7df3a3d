"""StructuredOutputsParams: what a request's output must match (vLLM's field names).

No torch and no grammar library here: SamplingParams imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, dict or JSON text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (Lark, or GBNF/EBNF with `::=`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON layout. Default: one line, `{"a": 1, "b": [2, 3]}` (", " and ": " separators, no
    # other whitespace), so a schema's keys and punctuation are forced tokens (free drafts) and
    # a small model cannot loop on newlines. `disable_any_whitespace`: `{"a":1,"b":[2,3]}`.
    # `whitespace_pattern`: a regex for the whitespace allowed between any two JSON tokens.
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a list of strings")
            if not self.choice:
                raise ValueError("StructuredOutputsParams.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (object or text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of "
                             f"{', '.join(KINDS)} (got {given or 'none'})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of what is asked: the compiled-grammar cache key."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:  # a schema sent as text shares the entry of the same schema as an object
                value = json.loads(value)
            except ValueError:
                pass  # compiling reports it
        if isinstance(value, (dict, tuple)):
            value = json.dumps(value, sort_keys=True)
        return json.dumps([self.kind, value, self.disable_any_whitespace,
                           self.whitespace_pattern])
