"""Prometheus metrics, in the server's own registry, every name prefixed `pagedserve_`.

Engine gauges and counters (running, waiting, KV usage, preemptions, tokens) are read from the
async engine's latest stats snapshot at scrape time; request outcomes and latency histograms are
recorded by the front ends, labelled with `protocol` ("http" here) so that gRPC can share them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedserve.engine import EngineStats
from pagedserve.output_stream import RequestStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def collect(self) -> Iterable:
        s = self._stats()
        if s is None:
            return []

        gauges = [
            ("num_requests_running", "Sequences in the engine's running batch", s.num_running),
            ("num_requests_waiting", "Sequences waiting for admission", s.num_waiting),
            ("kv_cache_usage", "Fraction of KV pages held by live sequences", s.kv_usage),
            ("kv_cache_pages_total", "KV pages in the pool", s.kv_pages_total),
            ("kv_cache_pages_cached", "KV pages holding prefix-cache entries", s.kv_pages_cached),
            ("kv_cache_tokens_total", "Token slots in the KV pool", s.kv_tokens_total),
            ("kv_cache_tokens_used", "KV slots filled by live sequences", s.kv_slots_filled),
            (
                "kv_cache_tokens_wasted",
                "KV slots allocated to live sequences but not filled (under a page each)",
                s.kv_slots_allocated - s.kv_slots_filled,
            ),
        ]
        counters = [
            ("num_preemptions", "Sequences preempted for lack of KV pages", s.num_preemptions),
            ("prompt_tokens", "Prompt tokens computed (prefix hits excluded)", s.prompt_tokens),
            ("generation_tokens", "Tokens generated", s.generation_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ]
        return [GaugeMetricFamily(f"pagedserve_{n}", d, value=v) for n, d, v in gauges] + [
            CounterMetricFamily(f"pagedserve_{n}", d, value=v) for n, d, v in counters
        ]


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None]):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine_stats))
        self.requests = Counter(
            "pagedserve_requests",
            "Requests answered, by protocol, endpoint and status code",
            ["protocol", "endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pagedserve_requests_in_flight",
            "Generation requests admitted and not yet answered",
            ["protocol"],
            registry=r,
        )
        self.finished = Counter(
            "pagedserve_request_finished",
            "Completions (choices) finished, by finish reason (stop, length, abort, error)",
            ["protocol", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "pagedserve_requests_rejected",
            "Requests refused before reaching the engine, by reason",
            ["protocol", "reason"],
            registry=r,
        )
        self.request_prompt_tokens = Counter(
            "pagedserve_request_prompt_tokens",
            "Prompt tokens of finished requests (usage.prompt_tokens)",
            ["protocol"],
            registry=r,
        )
        self.request_generation_tokens = Counter(
            "pagedserve_request_generation_tokens",
            "Generated tokens of finished requests (usage.completion_tokens)",
            ["protocol"],
            registry=r,
        )

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["protocol"], buckets=buckets, registry=r)

        self.ttft = hist(
            "pagedserve_time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS
        )
        self.tpot = hist(
            "pagedserve_time_per_output_token_seconds",
            "Mean time between output tokens after the first",
            _TPOT_BUCKETS,
        )
        self.e2e = hist(
            "pagedserve_e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "pagedserve_request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS
        )

    def record_finished(self, out: RequestStream, protocol: str) -> None:
        """One engine request reached its end (normally or by abort)."""
        for o in out.outputs:
            self.finished.labels(protocol, o.finish_reason or "abort").inc()
        usage = out.usage
        self.request_prompt_tokens.labels(protocol).inc(usage.prompt_tokens)
        self.request_generation_tokens.labels(protocol).inc(usage.completion_tokens)
        m = out.metrics
        if m is None or any(o.finish_reason == "abort" for o in out.outputs):
            return
        if m.first_scheduled_time is not None:
            self.queue_time.labels(protocol).observe(
                max(0.0, m.first_scheduled_time - m.arrival_time)
            )
        if m.first_token_time is not None:
            self.ttft.labels(protocol).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(protocol).observe(max(0.0, m.finished_time - m.arrival_time))
            longest = max((len(o.token_ids) for o in out.outputs), default=0)
            if m.first_token_time is not None and longest > 1:
                tpot = (m.finished_time - m.first_token_time) / (longest - 1)
                self.tpot.labels(protocol).observe(max(0.0, tpot))

    def record_error(self, n: int, protocol: str) -> None:
        self.finished.labels(protocol, "error").inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
