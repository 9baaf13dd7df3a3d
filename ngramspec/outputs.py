"""What a finished (or streaming) request returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ngramspec.engine.logprobs import TokenLogprob
from ngramspec.engine.sequence import Sequence


@dataclass(slots=True)
class RequestMetrics:
    ttft: float  # seconds from arrival to the first token
    decode_tok_s: float  # tokens/s after the first token
    e2e: float
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 0.0  # tokens per verify step, bonus included


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (params.prompt_logprobs)
    choices: list[RequestOutput] = field(default_factory=list, repr=False)  # n > 1 only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[RequestOutput]:
        """Every choice, in order (vLLM's `outputs`): n > 1 choices, or this one."""
        return self.choices or [self]


def output_text(seq: Sequence, tokenizer) -> str:
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
    return text if seq.stop_text_len is None else text[: seq.stop_text_len]


def build_output(seq: Sequence, tokenizer) -> RequestOutput:
    metrics = None
    if seq.finish_time is not None and seq.first_token_time is not None:
        decode_time = seq.finish_time - seq.first_token_time
        n = seq.num_output_tokens - 1
        metrics = RequestMetrics(
            ttft=seq.first_token_time - seq.arrival_time,
            decode_tok_s=n / decode_time if decode_time > 0 and n > 0 else 0.0,
            e2e=seq.finish_time - seq.arrival_time,
            num_verify_steps=seq.spec.num_verify_steps,
            num_draft_tokens=seq.spec.num_draft_tokens,
            num_accepted_tokens=seq.spec.num_accepted_tokens,
            mean_acceptance_length=seq.spec.mean_acceptance_length,
        )
    logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
    prompt = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
    return RequestOutput(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], seq.output_ids,
                         output_text(seq, tokenizer), seq.finish_reason, metrics, logprobs=logprobs,
                         prompt_logprobs=prompt)


def build_group_output(seq: Sequence, tokenizer) -> RequestOutput:
    """Choice 0's output carrying every choice (n > 1), or the sequence's own (n == 1)."""
    if not seq.choices:
        return build_output(seq, tokenizer)
    outputs = [build_output(s, tokenizer) for s in seq.choices]
    first = outputs[0]
    first.choices = outputs
    return first
