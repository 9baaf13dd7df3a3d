"""GrammarCompiler: StructuredOutputsParams -> an llguidance matcher, compiled once and cached.

Why llguidance (docs/benchmarks.md has the figures): a small wheel with no dependencies, where
xgrammar pulls in triton on x86 Linux; a schema compiles in about a millisecond and a token mask
takes microseconds on a 49k vocabulary; and it gives the tokens a grammar forces
(`compute_ff_tokens`), which we draft with probability 1.

Compiling builds the grammar and its first mask (llguidance builds its lexer lazily, so the first
mask is where a pathological regex shows); every request gets a `deep_copy` of the cached
matcher. Work is bounded by llguidance's parser limits (fuel), so a pathological schema fails
with an error instead of hanging; the server also bounds the wall time (`compile_timeout_s`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLParserLimits
from llguidance.gbnf_to_lark import gbnf_to_lark

from ngramspec.structured.params import StructuredOutputsParams

# JSON layouts (see StructuredOutputsParams): one line with spaces after "," and ":" by default.
# Free whitespace would let a small model emit newlines until max_tokens, and would leave no
# token forced; a fixed layout forces every key and separator of a schema's required fields.
JSON_ONE_LINE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The grammar, schema or regex cannot be compiled; the message names the problem."""


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec` (raises GrammarError for text that is not valid)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        options: dict[str, Any] = (
            JSON_COMPACT if spec.disable_any_whitespace
            else {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
            if spec.whitespace_pattern is not None else JSON_ONE_LINE)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from e
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                                    for c in spec.choice))
    text = spec.grammar
    if "::=" in text:  # GBNF / EBNF (llama.cpp, xgrammar); Lark uses ':'
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise GrammarError(f"invalid EBNF grammar: {e}") from e
    return LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and keeps the last `cache_size` of them (LRU).
    Thread-safe: the server compiles on worker threads while the engine thread copies."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids))
            return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher at the grammar's start (a copy of the cached compiled one)."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutputsParams) -> LLMatcher:
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._build(spec)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutputsParams) -> LLMatcher:
        text = grammar_text(spec)
        matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=LLParserLimits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer: pathological regexes fail here
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: "
                               f"{_first_lines(matcher.get_error())}")
        return matcher


def _first_lines(message: str, limit: int = 400) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."
