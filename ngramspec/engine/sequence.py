"""Sequence: one request's tokens, KV slots, status and counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ngramspec.engine.kv_cache import SlotList
from ngramspec.engine.logprobs import TokenLogprob
from ngramspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ngramspec.engine.prefix_cache import Node
    from ngramspec.structured.matcher import RequestGrammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SpecCounters:
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted drafts, bonus excluded
    num_emitted_tokens: int = 0  # tokens produced by verify steps, bonus included

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def add(self, other: SpecCounters) -> None:
        self.num_verify_steps += other.num_verify_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    status: Status = Status.WAITING
    slots: list[int] = field(default_factory=SlotList)  # KV slot of each cached token, in order
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)
    use_spec: bool = False
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., if asked
    grammar: RequestGrammar | None = None  # params.structured_outputs' matcher, at the last token
    # Prefix cache: slots[:num_shared] belong to the cache (the locked path ending at cache_node);
    # the rest are the sequence's own.
    cache_node: Node | None = None
    num_shared: int = 0
    # n > 1: every choice of the request, this one included, in choice order (empty: n == 1)
    choices: list[Sequence] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached(self) -> int:
        return len(self.slots)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """Everything but the last token (the root of the next step) has its K/V cached."""
        return self.num_cached == self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
