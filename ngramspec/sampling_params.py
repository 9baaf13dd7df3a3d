"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
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

    @property
    def greedy(self) -> bool:
        # Like vLLM: a temperature this small would overflow the softmax; it means greedy.
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


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
