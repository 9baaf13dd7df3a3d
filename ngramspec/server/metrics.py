"""Prometheus metrics of one server, in its own registry (no process-global state).

Two families: our own `ngramspec_*` metrics, and vLLM's `vllm:*` names (with vLLM's `model_name`
label) for the ones we have the data for, so dashboards and autoscalers built for vLLM read this
server unchanged. Prometheus allows ':' in metric names; counters get `_total` as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ngramspec.engine.engine import LLMEngine, StepOutput
from ngramspec.engine.prefix_cache import PrefixCache
from ngramspec.server.async_engine import EngineSnapshot

PREFIX = "ngramspec_"
VLLM = "vllm:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(slots=True)
class _SeqSpec:
    """A running request's speculation counters as of the last step that reported it."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class ServerMetrics:
    def __init__(self, max_acceptance_length: int = 16, model_name: str = "ngramspec",
                 max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
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
        # a tree of max_acceptance_length nodes has at most that many - 1 draft positions
        self.vllm = VllmMetrics(r, model_name, max_model_len, max(max_acceptance_length - 1, 0))
        self._last_times = (0.0, 0.0)
        self._last_spec = (0, 0)
        self._last_failures = 0
        self._last_prefix = (0, 0)  # the prefix cache's (queries, hits) in tokens
        self._seq_spec: dict[int, _SeqSpec] = {}  # seq_id -> counters seen (engine thread)

    # ---- the request path (event loop) ----------------------------------------------------
    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.vllm.prompt_tokens.inc(num_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def on_token_gap(self, seconds: float, count: int) -> None:
        """`count` tokens that arrived together, `seconds` apart each."""
        for _ in range(count):
            self.itl.observe(seconds)
            self.vllm.itl.observe(seconds)

    def on_tokens(self, count: int) -> None:
        self.generation_tokens.inc(count)
        self.vllm.generation_tokens.inc(count)

    def on_finish(self, reason: str | None, e2e: float, prompt_tokens: int,
                  generation_tokens: int) -> None:
        """`reason` None: the request failed (counted as "error", no latency)."""
        self.finished.labels(reason or "error").inc()
        if reason is None:
            return
        v = self.vllm
        self.e2e.observe(e2e)
        v.e2e.observe(e2e)
        v.success.labels(self.model_name, reason).inc()
        v.request_prompt_tokens.observe(prompt_tokens)
        v.request_generation_tokens.observe(generation_tokens)

    # ---- the engine thread, after every step (prometheus_client is thread-safe) -------------
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
        self._observe_prefix_cache(engine.scheduler.cache)
        for out in outputs:
            self._observe_verify(out)
        if len(self._seq_spec) > 2 * engine.scheduler.max_num_seqs:
            # Aborted requests never finish through step(): drop what is no longer live.
            live = {s.seq_id for s in (*engine.scheduler.running, *engine.scheduler.waiting)}
            self._seq_spec = {k: v for k, v in self._seq_spec.items() if k in live}

    def _observe_verify(self, out: StepOutput) -> None:
        """One request's verify step, if this step verified it: the sequence's counters grow by
        at most one verify step per engine step, so their growth is this step's draft."""
        seq = out.seq
        spec, last = seq.spec, self._seq_spec.get(seq.seq_id, _SeqSpec())
        if spec.num_verify_steps > last.verify_steps:
            self.acceptance.observe(len(out.new_token_ids))
            self.vllm.observe_draft(spec.num_draft_tokens - last.draft_tokens,
                                    spec.num_accepted_tokens - last.accepted_tokens)
        if seq.is_finished:
            self._seq_spec.pop(seq.seq_id, None)
        elif spec.num_verify_steps:
            self._seq_spec[seq.seq_id] = _SeqSpec(spec.num_verify_steps, spec.num_draft_tokens,
                                                  spec.num_accepted_tokens)

    def _observe_prefix_cache(self, cache: PrefixCache | None) -> None:
        if cache is None:
            return
        queries, hits = cache.queries, cache.hits
        last_queries, last_hits = self._last_prefix  # the cache's totals only grow
        self.vllm.prefix_queries.inc(queries - last_queries)
        self.vllm.prefix_hits.inc(hits - last_hits)
        self._last_prefix = (queries, hits)

    def render(self, snapshot: EngineSnapshot, corpus_tokens: int) -> bytes:
        used = snapshot.kv_usable - snapshot.kv_free
        usage = used / snapshot.kv_usable if snapshot.kv_usable else 0.0
        self.kv_usage.set(usage)
        self.kv_free.set(snapshot.kv_free)
        self.kv_cached.set(snapshot.kv_cached)
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.corpus_tokens.set(corpus_tokens)
        self.vllm.kv_usage.set(usage)
        self.vllm.running.set(snapshot.num_running)
        self.vllm.waiting.set(snapshot.num_waiting)
        return generate_latest(self.registry)


class VllmMetrics:
    """vLLM's metric names and meanings, labelled with the served model's name."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int,
                 num_positions: int = 0) -> None:
        v, label = VLLM, ["model_name"]
        self.model_name = model_name

        def counter(name: str, doc: str) -> Counter:
            return Counter(v + name, doc, label, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(v + name, doc, label, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(v + name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Number of requests in model execution")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens")
        self.success = Counter(v + "request_success", "Count of successfully processed requests",
                               ["model_name", "finished_reason"], registry=r)
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed", tokens)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds", LATENCY_BUCKETS)
        self.num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Number of accepted tokens")
        self.accepted_per_pos = Counter(v + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position",
                                        ["model_name", "position"], registry=r)
        # Every position's series exists from the start (at 0), as vLLM's dashboards expect;
        # a deeper path than announced (a changed drafter config) still adds its positions.
        self._per_pos: list[Counter] = [self.accepted_per_pos.labels(model_name, str(i))
                                        for i in range(num_positions)]

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step of one request: `num_accepted` drafts of its tree's accepted path
        (a path from the root, so position i is accepted when the path is longer than i)."""
        if num_draft_tokens <= 0:
            return  # a plain decode step under speculation: no draft
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_draft_tokens)
        self.num_accepted_tokens.inc(num_accepted)
        while len(self._per_pos) < num_accepted:
            self._per_pos.append(self.accepted_per_pos.labels(self.model_name,
                                                              str(len(self._per_pos))))
        for position in range(num_accepted):
            self._per_pos[position].inc()
