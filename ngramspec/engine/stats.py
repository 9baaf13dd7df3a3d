"""EngineStats: counters and timings of an engine over its lifetime."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ngramspec.engine.sequence import SpecCounters


@dataclass(slots=True)
class EngineStats(SpecCounters):
    """Every request's verify counters summed (SpecCounters.add), plus step counts and timings."""

    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    draft_time: float = 0.0  # schedule + propose + reserve
    forward_time: float = 0.0
    step_time: float = 0.0
    # the device's own time in forwards (CUDA events; the forward's wall time on the CPU): with
    # step_time, how busy the accelerator is kept
    device_time: float = 0.0
    # drafting done while the accelerator ran a step (Speculator.overlap): in step_time only
    overlapped_draft_time: float = 0.0
    draft_failures: int = 0  # steps whose drafting raised and that decoded without drafts
    grammar_mask_time: float = 0.0  # computing and applying grammar masks (structured outputs)
    grammar_mask_rows: int = 0  # rows masked: one per tree node (root included)

    def add_step(self, draft: float, forward: float, total: float) -> None:
        self.num_steps += 1
        self.draft_time += draft
        self.forward_time += forward
        self.step_time += total

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["mean_acceptance_length"] = self.mean_acceptance_length
        steps = max(self.num_steps, 1)
        d["draft_ms_per_step"] = 1000 * self.draft_time / steps
        d["forward_ms_per_step"] = 1000 * self.forward_time / steps
        d["device_ms_per_step"] = 1000 * self.device_time / steps
        if self.grammar_mask_rows:
            d["grammar_mask_us_per_node"] = 1e6 * self.grammar_mask_time / self.grammar_mask_rows
        return d
