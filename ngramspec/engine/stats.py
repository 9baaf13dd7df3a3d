"""EngineStats: counters and timings of an engine over its lifetime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_verify_steps: int = 0  # per-request verify steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_time: float = 0.0
    forward_time: float = 0.0
    step_time: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["mean_acceptance_length"] = self.mean_acceptance_length
        steps = max(self.num_steps, 1)
        d["draft_ms_per_step"] = 1000 * self.draft_time / steps
        d["forward_ms_per_step"] = 1000 * self.forward_time / steps
        return d
