"""The server's Prometheus metrics, in a registry of its own: per-request figures from the
engine loop, HTTP counts from the middleware, engine-wide ones from the latest llm.stats()
snapshot. docs/serving.md lists every name.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "jaxinfer_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    """Engine-wide gauges and counters from the latest stats snapshot."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        s, pending = self.metrics.stats, self.metrics.pending
        if s is None:
            return

        def gauge(name, doc, value):
            return GaugeMetricFamily(PREFIX + name, doc, value=float(value))

        def counter(name, doc, value):
            return CounterMetricFamily(PREFIX + name, doc, value=float(value))

        yield gauge("requests_running", "Requests holding a batch slot.", s.get("running", 0))
        yield gauge("requests_waiting", "Requests accepted and waiting for a batch slot "
                    "(queued in the engine or on their way to it).", s.get("waiting", 0) + pending)
        if "num_pages" in s:
            yield gauge("kv_pages_total", "KV cache pages in the pool.", s["num_pages"])
            yield gauge("kv_pages_used", "KV cache pages held by requests.", s["pages_used"])
            yield gauge("kv_pages_cached", "Free KV pages still holding a cached prefix.",
                        s["pages_cached"])
            yield gauge("kv_page_utilization", "Fraction of usable KV pages held by requests.",
                        s["page_utilization"])
            yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache "
                        "over prompt tokens looked up, since start.", s["prefix_cache_hit_rate"])
            yield counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                          "cache.", s["prefix_cache_hit_tokens"])
            yield counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                          "cache.", s["prefix_cache_query_tokens"])
        yield counter("preemptions", "Requests preempted (pages freed, recomputed later).",
                      s.get("preemptions", 0))
        if "draft_tokens" in s:
            yield counter("spec_draft_tokens", "Speculative tokens proposed.", s["draft_tokens"])
            yield counter("spec_accepted_tokens", "Speculative tokens accepted.",
                          s["accepted_tokens"])
            yield gauge("spec_acceptance_rate", "Accepted over proposed speculative tokens, "
                        "since start.", s["acceptance_rate"])


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.stats: Optional[dict] = None
        self.pending = 0
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and "
                                "status code.", ["endpoint", "status"], registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "Requests the engine finished, by "
                                "finish reason (stop, length, abort).", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival at the server "
                              "to the first generated token.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between generated "
                             "tokens of a request (a burst of k tokens after a gap g counts k "
                             "times g/k).", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival at the server to "
                             "the request's end.", buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that "
                                     "produced a first token.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         registry=r)
        r.register(_EngineCollector(self))

    # Engine-loop hooks (engine thread).
    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)

    def on_gap(self, gap_s: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(gap_s / tokens)

    def on_tokens(self, tokens: int) -> None:
        if tokens > 0:
            self.generation_tokens.inc(tokens)

    def on_finish(self, reason: str, e2e_s: float) -> None:
        self.finished.labels(finish_reason=reason).inc()
        self.e2e.observe(e2e_s)

    def on_stats(self, stats: dict, pending: int) -> None:
        self.stats, self.pending = stats, pending

    # HTTP side.
    def on_response(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
