"""OpenAI request models, the OpenAI error body, and the checks that turn a request into
SamplingParams.

Unknown fields are ignored, as OpenAI's API does for fields it does not know. Fields OpenAI or
vLLM define but we cannot honour (`suffix`, `use_beam_search`, `priority`, ... : UNSUPPORTED)
get a 400 with code `unsupported_parameter` naming the field, unless their value asks for
nothing (null, false, 0, the default), so a client never silently gets something other than
what it asked for. A null optional field means its default, as the openai client sends an
explicit None; types stay strict otherwise ("0.5" is not a number).

vLLM's sampling extensions are honoured on both routes, with vLLM's meaning: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `logit_bias` (OpenAI's too),
`allowed_token_ids`, `bad_words`, `include_stop_str_in_output`, `skip_special_tokens`,
`add_special_tokens` (off by default, as LLM.generate encodes); and on chat
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`.

Structured outputs come as OpenAI's `response_format` or vLLM's extra-body fields
(`structured_outputs: {json|regex|choice|grammar|json_object}`, and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`); at most one per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ngramspec.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from ngramspec.structured.params import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
# apply_chat_template's own arguments: chat_template_kwargs may not set them (they are fields of
# their own, or ours to set; "chat_template" would run the client's Jinja)
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code=code)


# ---- models ---------------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "0.5" is not a number and true is not an integer, as in OpenAI's API.
    model_config = ConfigDict(strict=True, extra="ignore")


class NgramHints(_Strict):
    """Our extension `"ngram": {...}`: drafting hints for this request only."""

    model_config = ConfigDict(strict=True, extra="forbid")  # our own field: typos are errors
    reference: str | list[str] | None = None  # documents the drafter may copy from
    enabled: bool = True  # False opts this request out of speculation

    @property
    def references(self) -> list[str]:
        if self.reference is None:
            return []
        return [self.reference] if isinstance(self.reference, str) else list(self.reference)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` extra-body field."""

    model_config = ConfigDict(strict=True, extra="forbid")  # typos are errors, not ignored
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


# OpenAI's logit_bias: token id (a string key in JSON) -> bias added to its logit
LogitBias = dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]


class _GenerationRequest(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """A null optional field is its default: OpenAI documents its optional fields as
        nullable, and the openai client sends an explicit None as null."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required()}

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM-style extensions
    top_k: int = Field(0, ge=-1, lt=2**31)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    ngram: NgramHints | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field asked; 400 if several did."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            fields = {"json": so.json_schema, "regex": so.regex, "choice": so.choice,
                      "grammar": so.grammar, "json_object": so.json_object}
            asked.append(("structured_outputs",
                          {k: v for k, v in fields.items() if v not in (None, False)}
                          | {"disable_any_whitespace": so.disable_any_whitespace,
                             "whitespace_pattern": so.whitespace_pattern}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if not asked:
            return None
        if len(asked) > 1:
            raise bad_request("ask for one structured output at a time (got "
                              f"{', '.join(n for n, _ in asked)})", asked[1][0])
        param, fields = asked[0]
        if self.guided_whitespace_pattern is not None and param != "structured_outputs":
            fields["whitespace_pattern"] = self.guided_whitespace_pattern
        if isinstance(fields.get("json"), bool):
            fields["json"] = {} if fields["json"] else {"not": {}}
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as e:
            raise bad_request(f"{param}: {str(e).removeprefix('StructuredOutputsParams.')}",
                              param) from e

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the k most likely alternatives."""
        return None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt is returned before the completion (with its logprobs)
    # best_of candidates are generated; the n with the highest log-probability are returned
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    # The tokenizer's BOS etc. on a text prompt. Off by default, as LLM.generate encodes; vLLM's
    # default is on, so a client that relies on it says so.
    add_special_tokens: bool = False

    @property
    def num_candidates(self) -> int:
        if self.best_of is None:
            return self.n
        if self.best_of < self.n:
            raise bad_request(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.stream and self.best_of > self.n:
            raise bad_request("best_of > n cannot be streamed", "best_of")
        return self.best_of

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        # The chat template knows "system"; OpenAI's "developer" role means the same.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": text if text is not None else ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat template fields
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    add_generation_prompt: bool | None = None  # None: True unless continue_final_message
    continue_final_message: bool = False  # the last (assistant) message is continued
    add_special_tokens: bool = False  # the tokenizer's BOS etc. on top of the template's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_arguments(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if taken := sorted(TEMPLATE_ARGUMENTS & set(kwargs or {})):
            raise ValueError(f"{', '.join(taken)} cannot be set here (a request field of its "
                             "own, or the server's)")
        return kwargs

    def template_options(self) -> dict[str, Any]:
        """Encoder.chat's keyword arguments for this request's template fields."""
        add_prompt = self.add_generation_prompt
        if add_prompt is None:
            add_prompt = not self.continue_final_message
        if add_prompt and self.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                              "true", "continue_final_message")
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return {"template_kwargs": kwargs or None, "add_generation_prompt": add_prompt,
                "add_special_tokens": self.add_special_tokens}

    @property
    def tool_mode(self) -> str:
        """"none" (tools unused), "auto", "required" or "named"."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return "none"
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is not "
                                  "among tools", "tool_choice")
            return "named"
        return choice

    @property
    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CorpusAddRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    documents: list[str] | None = None
    path: str | None = None  # relative to --corpus-dir
    wait: bool = True  # False: answer 202 at once, the load continues in the background


class StatePathRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    path: str | None = None  # relative to --corpus-dir; None = --corpus-state


# ---- parsing --------------------------------------------------------------------------------

def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from e


def _nothing(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == [] \
        or value == {}


# Fields OpenAI or vLLM define that we cannot honour, and which of their values ask for nothing.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # OpenAI's
    "suffix": _nothing,
    "functions": _nothing,  # the deprecated form of tools
    "function_call": lambda v: v is None or v == "none",
    "audio": _nothing,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _nothing,
    # vLLM's request extensions
    "use_beam_search": _nothing,
    "length_penalty": lambda v: v is None or v == 1,
    "truncate_prompt_tokens": lambda v: v is None,
    "prompt_logprobs": lambda v: v is None,  # completions: echo with logprobs gives them
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    "guided_decoding_backend": _nothing,
    "structural_tag": _nothing,
    "priority": _nothing,
    "request_id": lambda v: v is None,
    "logits_processors": _nothing,
    "return_tokens_as_token_ids": _nothing,
    "return_token_ids": _nothing,
    "cache_salt": lambda v: v is None,
    "kv_transfer_params": _nothing,
    "vllm_xargs": _nothing,
    "mm_processor_kwargs": _nothing,
    "prompt_embeds": _nothing,
}
# ... and those of one route only (vLLM's meaning there)
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "echo": _nothing,  # vLLM: the reply is prefixed with the last message of its role
    "best_of": lambda v: _nothing(v) or v == 1,
    "documents": _nothing,
    "chat_template": lambda v: v is None,  # the client's Jinja: not run on this server
}
UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {}


def check_unsupported(body: dict[str, Any],
                      route_fields: dict[str, Callable[[Any], bool]] | None = None) -> None:
    for name, asks_nothing in (UNSUPPORTED | (route_fields or {})).items():
        if name in body and not asks_nothing(body[name]):
            raise bad_request(f"ngramspec does not support {name}={body[name]!r}", name,
                              code="unsupported_parameter")
    options = body.get("stream_options")
    if isinstance(options, dict) and not _nothing(options.get("continuous_usage_stats")):
        raise bad_request("ngramspec does not support stream_options.continuous_usage_stats",
                          "stream_options.continuous_usage_stats", code="unsupported_parameter")
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if content is None and not (message.get("role") == "assistant"
                                    and message.get("tool_calls")):
            # only an assistant turn that calls tools may come without content
            raise bad_request(f"messages.{i}.content: Field required", f"messages.{i}.content")
        if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") != "text" for part in content):
            raise bad_request("ngramspec supports only text content parts", f"messages.{i}.content",
                              code="unsupported_parameter")


def validate(model: type[BaseModel], body: Any) -> Any:
    """The body as `model`; OpenAI-style 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    route = {ChatCompletionRequest: UNSUPPORTED_CHAT, CompletionRequest: UNSUPPORTED_COMPLETION}
    check_unsupported(body, route.get(model))
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p)) or None
        raise bad_request(f"{param}: {err['msg']}" if param else err["msg"], param) from e


def _is_type_tag(part: Any) -> bool:
    # pydantic puts the union member tried ("str", "list[int]") into error locations.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or part.startswith(("list[", "function-")))


# ---- sampling -------------------------------------------------------------------------------

def sampling_params(req: _GenerationRequest, num_prompt_tokens: int, max_model_len: int,
                    default_max_tokens: int | None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams for `req`; 400 for anything SamplingParams or the context rejects."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(f"the prompt has {num_prompt_tokens} tokens but this model's context "
                          f"is {max_model_len} tokens (prompt + at least one new token)",
                          "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                          code="context_length_exceeded")
    max_tokens = req.requested_max_tokens
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None \
        else "max_tokens"
    if max_tokens is None:  # at least min_tokens (else that is a 400 below), within the room
        default = room if default_max_tokens is None else max(default_max_tokens, req.min_tokens)
        max_tokens = min(default, room)
    elif max_tokens > room:
        raise bad_request(f"this model's context is {max_model_len} tokens; the prompt has "
                          f"{num_prompt_tokens}, so {param} must be at most {room} "
                          f"(got {max_tokens})", param, code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings of at most "
                          f"{MAX_STOP_CHARS} characters", "stop")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not math.isfinite(getattr(req, name)):
            raise bad_request(f"{name} must be finite", name)
    # Dividing logits by a denormal temperature overflows to inf and NaN probabilities; like
    # vLLM, anything this small means greedy.
    temperature = 0.0 if req.temperature < MIN_TEMPERATURE else req.temperature
    try:
        return SamplingParams(
            max_tokens=max_tokens, n=getattr(req, "num_candidates", req.n),
            temperature=temperature, top_k=req.top_k, top_p=req.top_p,
            min_p=req.min_p, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            speculative=req.ngram is None or req.ngram.enabled,
            logprobs=_logprobs_for(req), logprobs_mode=req.logprobs_mode,
            prompt_logprobs=getattr(req, "requested_prompt_logprobs", None),
            structured_outputs=structured, min_tokens=req.min_tokens,
            stop_token_ids=list(req.stop_token_ids or []),
            logit_bias=dict(req.logit_bias) if req.logit_bias else None,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:
        raise bad_request(str(e).removeprefix("SamplingParams."), _param_of(str(e), param)) from e


def check_token_ids(req: _GenerationRequest, vocab_size: int) -> None:
    """logit_bias and allowed_token_ids name tokens of this model (400 otherwise, as vLLM)."""
    for name, ids in (("logit_bias", list(req.logit_bias or {})),
                      ("allowed_token_ids", req.allowed_token_ids or [])):
        bad = [t for t in ids if not (str(t).isdigit() and int(t) < vocab_size)]
        if bad:
            raise bad_request(f"{name}: token ids must be integers in [0, {vocab_size}) "
                              f"(got {bad[:8]})", name)


def _logprobs_for(req: _GenerationRequest) -> int | None:
    """The request's logprobs, or 0 when best_of ranks candidates by their log-probability."""
    asked = req.requested_logprobs
    if asked is None and getattr(req, "num_candidates", req.n) > req.n:
        return 0
    return asked


def _param_of(message: str, max_tokens_param: str) -> str | None:
    """`SamplingParams.top_p=0 must be ...` -> "top_p" (max_tokens as the client spelled it)."""
    head = message.removeprefix("SamplingParams.").split("=", 1)[0]
    if not head.isidentifier():
        return None
    return max_tokens_param if head == "max_tokens" else head
