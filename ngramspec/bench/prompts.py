"""BenchPrompt, the unit of every benchmark workload, and the per-category limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ngramspec.structured.params import StructuredOutputsParams


@dataclass(slots=True)
class BenchPrompt:
    id: str
    category: str
    text: str  # the user message
    max_tokens: int | None = None  # the workload's own need; None = the benchmark default
    structured: StructuredOutputsParams | None = None  # the output's grammar, if any
    system: str | None = None  # a system message before `text` (tool definitions)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.text}]


# ---- shared helpers ---------------------------------------------------------------------------

def spread_indices(n: int, k: int | None) -> list[int]:
    """k indices spread evenly over range(n), first included; all of them when k is None or >= n."""
    if k is None or k >= n:
        return list(range(n))
    if k <= 0:
        return []
    return [i * n // k for i in range(k)]


def limit_per_category(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """At most `limit` prompts per category, spread over it; the kept ones stay in input order."""
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    keep = {group[j] for group in by_cat.values() for j in spread_indices(len(group), limit)}
    return [p for i, p in enumerate(prompts) if i in keep]
