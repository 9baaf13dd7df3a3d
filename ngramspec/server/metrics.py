"""Prometheus metrics of one server, in its own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ngramspec.engine.engine import LLMEngine, StepOutput
from ngramspec.server.async_engine import EngineSnapshot

PREFIX = "ngramspec_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, max_acceptance_length: int = 16) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.finished = Counter(p + "request_finished", "Generation requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time per output token after the first (a speculative burst of k "
                             "tokens counts k times, gap / k each)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.acceptance = Histogram(
            p + "acceptance_length", "Tokens per verify step (accepted drafts + bonus)",
            buckets=tuple(range(1, max_acceptance_length + 2)), registry=r)
        self.draft_time = Histogram(p + "draft_time_seconds", "Drafting time per engine step",
                                    buckets=STEP_BUCKETS, registry=r)
        self.verify_time = Histogram(p + "verify_time_seconds",
                                     "Forward (verify) time per engine step",
                                     buckets=STEP_BUCKETS, registry=r)
        self.draft_tokens = Counter(p + "spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.draft_failures = Counter(p + "spec_draft_failures",
                                      "Steps whose drafting raised (they decoded without drafts)",
                                      registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV slots in use",
                              registry=r)
        self.kv_free = Gauge(p + "kv_cache_free_slots", "Free KV slots", registry=r)
        self.kv_cached = Gauge(p + "prefix_cache_slots", "KV slots the prefix cache holds",
                               registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued", registry=r)
        self.corpus_tokens = Gauge(p + "external_corpus_tokens", "Tokens in external corpora",
                                   registry=r)
        self._last_times = (0.0, 0.0)
        self._last_spec = (0, 0)
        self._last_failures = 0
        self._verify_steps: dict[int, int] = {}  # seq_id -> verify steps seen (engine thread)

    # Runs on the engine thread after every step (prometheus_client is thread-safe).
    def on_step(self, engine: LLMEngine, outputs: list[StepOutput]) -> None:
        stats = engine.stats
        draft, forward = self._last_times
        self.draft_time.observe(stats.draft_time - draft)
        self.verify_time.observe(stats.forward_time - forward)
        self._last_times = (stats.draft_time, stats.forward_time)
        drafted, accepted = self._last_spec
        self.draft_tokens.inc(stats.num_draft_tokens - drafted)
        self.accepted_tokens.inc(stats.num_accepted_tokens - accepted)
        self._last_spec = (stats.num_draft_tokens, stats.num_accepted_tokens)
        if stats.draft_failures > self._last_failures:
            self.draft_failures.inc(stats.draft_failures - self._last_failures)
            self._last_failures = stats.draft_failures
        for out in outputs:
            seq = out.seq
            steps = seq.spec.num_verify_steps
            if steps > self._verify_steps.get(seq.seq_id, 0):
                self.acceptance.observe(len(out.new_token_ids))
            if seq.is_finished:
                self._verify_steps.pop(seq.seq_id, None)
            elif steps:
                self._verify_steps[seq.seq_id] = steps

        if len(self._verify_steps) > 2 * engine.scheduler.max_num_seqs:
            # Aborted requests never finish through step(): drop what is no longer live.
            live = {s.seq_id for s in (*engine.scheduler.running, *engine.scheduler.waiting)}
            self._verify_steps = {k: v for k, v in self._verify_steps.items() if k in live}

    def render(self, snapshot: EngineSnapshot, corpus_tokens: int) -> bytes:
        used = snapshot.kv_usable - snapshot.kv_free
        self.kv_usage.set(used / snapshot.kv_usable if snapshot.kv_usable else 0.0)
        self.kv_free.set(snapshot.kv_free)
        self.kv_cached.set(snapshot.kv_cached)
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.corpus_tokens.set(corpus_tokens)
        return generate_latest(self.registry)
