"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ngramspec.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives a token may report (OpenAI's top_logprobs bound)
MAX_N = 64  # choices per request
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    # Choices per prompt: the prompt's K/V is computed once (the prefix cache), choice i samples
    # with seed + i when a seed is given (vLLM's rule) and speculates on its own.
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    speculative: bool = True  # lets a request opt out of speculation
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the k most likely
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (see engine/logprobs.py)
    prompt_logprobs: int | None = None  # the same for prompt tokens 2.. (raw: nothing processed them)
    # the output must match a JSON schema, regex, choice or grammar (vLLM's name and fields)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's fields, vLLM's meaning. min_tokens: the first min_tokens output tokens cannot be
    # EOS or a stop token id (they are masked) and no stop string may end inside their text.
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # never completed: a word's last token is masked
    include_stop_str_in_output: bool = False  # the matched stop string stays in the text
    skip_special_tokens: bool = True  # special tokens are dropped from the output text
    # Filled by the engine from the model (vLLM's update_from_tokenizer / _all_stop_token_ids):
    # the EOS ids min_tokens masks besides stop_token_ids, and bad_words as token-id sequences.
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):
            # JSON object keys are strings; vLLM takes {"50256": -100} too
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               "max_tokens", self.max_tokens, "must be an integer")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_N,
               "n", self.n, f"must be an integer in [1, {MAX_N}]")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               self.temperature, "must be a number >= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k,
               "must be -1, 0 (disabled) or a positive integer")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
               "must be in (0, 1]")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
               "must be in [0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed,
               "must be an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs,
               f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               f"must be one of {LOGPROBS_MODES}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs,
               "must be a StructuredOutputsParams or None")
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", self.min_tokens,
               f"must be an integer in [0, max_tokens] (max_tokens={self.max_tokens})")
        _check(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 for k in self.logit_bias)
            and all(_is_number(v) and math.isfinite(v) for v in self.logit_bias.values())),
            "logit_bias", self.logit_bias,
            "must be None or a dict of token ids (>= 0) to finite numbers")
        _check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", self.allowed_token_ids,
            "must be None or a non-empty list of token ids (>= 0)")
        _check(self.bad_words is None or (
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
            "bad_words", self.bad_words, "must be None or a list of non-blank strings")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name),
                   "must be a bool")

    @property
    def greedy(self) -> bool:
        # Like vLLM: a temperature this small would overflow the softmax; it means greedy.
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def processes_logits(self) -> bool:
        """Whether sampling changes the raw logits before temperature (layers.sampler's
        process_logits), so a row's argmax is not the token greedy decoding emits."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self._bad_words_token_ids))

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        """What min_tokens masks: stop_token_ids and the model's EOS ids (vLLM masks EOS even
        with ignore_eos)."""
        return tuple(dict.fromkeys([*self.stop_token_ids, *self._eos_token_ids]))

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        return self._bad_words_token_ids


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(key: object) -> object:
    """A logit_bias key as a token id ("50256" -> 50256); anything else is left for the check."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {why}")


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of an n > 1 request: one choice, its own seed stream (seed + index)."""
    fields = {name: getattr(params, name) for name in params.__slots__}
    fields["n"] = 1
    if params.seed is not None:
        fields["seed"] = params.seed + index
    return SamplingParams(**fields)


def resolve_for_model(params: SamplingParams, eos_token_ids: Iterable[int],
                      encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with what its logit processing needs from the model: the EOS ids (min_tokens
    masks them) and bad_words as token ids (`encode`: text -> ids, no special tokens)."""
    words = _bad_words_ids(params.bad_words or [], encode)
    return dataclasses.replace(params, _eos_token_ids=tuple(eos_token_ids),
                               _bad_words_token_ids=words)


def _bad_words_ids(words: list[str], encode: Callable[[str], list[int]]
                   ) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as it tokenises at the start of a text and, where that differs
    and is as many tokens, after a space (a word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)
