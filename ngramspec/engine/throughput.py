"""Learn online whether drafting pays, from observed step throughput.

The cost curve is measured at start-up for one sequence; at larger batches host overheads and
attention padding make verify steps dearer than it predicts. So every decode-only step reports
its tokens per second, split by batch-size bucket and by whether it drafted; when drafting steps
are slower than plain ones, a penalty on the marginal draft cost rises (and decays otherwise).
One step in `PROBE_EVERY` skips drafting so the plain rate stays measured.
"""

from __future__ import annotations

PROBE_EVERY = 16
EMA = 0.1
MAX_PENALTY = 50.0


def _bucket(num_seqs: int) -> int:
    return min(num_seqs.bit_length(), 6)  # 1, 2-3, 4-7, 8-15, 16-31, 32+


class ThroughputGuard:
    def __init__(self) -> None:
        self.rate: dict[tuple[int, bool], float] = {}
        self.penalty: dict[int, float] = {}
        self.steps = 0

    def penalty_for(self, num_seqs: int) -> float:
        return self.penalty.get(_bucket(num_seqs), 1.0)

    def should_probe(self) -> bool:
        self.steps += 1
        return self.steps % PROBE_EVERY == 0

    def observe(self, num_seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        b = _bucket(num_seqs)
        key = (b, drafted)
        rate = tokens / seconds
        self.rate[key] = rate if key not in self.rate else (1 - EMA) * self.rate[key] + EMA * rate
        spec, plain = self.rate.get((b, True)), self.rate.get((b, False))
        if spec is None or plain is None:
            return
        p = self.penalty.get(b, 1.0)
        self.penalty[b] = min(MAX_PENALTY, p * 1.05) if spec < plain else max(1.0, p / 1.02)
