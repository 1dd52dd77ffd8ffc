"""Prometheus metrics of one server, under the ``specdecode:`` prefix with vLLM's names where
vLLM has one (so dashboards carry over). Each server owns its registry: two servers in one
process (tests) never share counters.

Counters move when a request finishes (cancelled ones included), so after a run they agree with
the responses' ``usage``; gauges are set after every engine step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdecode.metrics import RequestMetrics

PREFIX = "specdecode:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
disable_created_metrics()  # no *_created series: vLLM's dashboards do not read them

E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The metrics a server exports; ``render()`` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model = model

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.drafts = counter("spec_decode_num_drafts", "Speculative rounds that drafted at least one token")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft", ("position",)
        )
        self.drafted_per_pos = counter(
            "spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed, by position in the draft", ("position",)
        )
        self.target_calls = counter("spec_decode_num_target_calls", "Target forwards (verify rounds) of requests")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens taken from the prefix cache, not prefilled")
        self.requests = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's emissions", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before prefill", E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the batch")
        self.waiting = gauge("num_requests_waiting", "Requests in the queue")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV budget reserved by running requests (0-1)")
        self.k_chosen = gauge("spec_decode_k", "Mean drafts per decoding request the policies chose in the last step")
        self.batch = gauge("num_requests_decoding", "Requests decoding (not prefilling) in the last step")

    def _l(self, metric, **extra: str):
        return metric.labels(model_name=self.model, **extra)

    def step(self, running: int, waiting: int, kv_usage: float, ks: tuple[int, ...] | None) -> None:
        self._l(self.running).set(running)
        self._l(self.waiting).set(waiting)
        self._l(self.kv_usage).set(kv_usage)
        if ks:
            self._l(self.k_chosen).set(sum(ks) / len(ks))
            self._l(self.batch).set(len(ks))

    def first_token(self, seconds: float) -> None:
        self._l(self.ttft).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._l(self.itl).observe(seconds)

    def finished(self, m: RequestMetrics, reason: str, e2e_s: float) -> None:
        """A request left the engine (``m``: its metrics)."""
        self._l(self.drafts).inc(sum(m.histogram.values()))
        self._l(self.draft_tokens).inc(m.drafted_tokens)
        self._l(self.accepted_tokens).inc(m.accepted_tokens)
        for pos, (drafted, accepted) in enumerate(zip(m.position_drafted, m.position_accepted)):
            self._l(self.drafted_per_pos, position=str(pos)).inc(drafted)
            self._l(self.accepted_per_pos, position=str(pos)).inc(accepted)
        self._l(self.target_calls).inc(m.target_calls)
        self._l(self.prompt_tokens).inc(m.prompt_tokens)
        self._l(self.prefix_queries).inc(m.prompt_tokens)
        self._l(self.prefix_hits).inc(m.cached_tokens)
        self._l(self.generation_tokens).inc(m.new_tokens)
        self._l(self.requests, finished_reason=reason).inc()
        self._l(self.e2e).observe(e2e_s)
        self._l(self.queue).observe(m.queue_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
