"""Server metrics for Prometheus, kept and exposed by `prometheus_client`.

The engine loop's API side writes most of them (async_engine.py: it sees every token as it
arrives); handlers count the requests they refuse or that fail; `/metrics` reads. Gauges (queue lengths, KV
blocks) are read from the engine's latest `kv_stats()` at scrape time; counters and
histograms accumulate. Names follow vLLM's where one exists (`vllm:num_preemptions` is
`llmlab_num_preemptions` here), so a Grafana dashboard for one reads the other with a
prefix change. Each app has its own registry: two servers in one notebook do not mix.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class KVStatsCollector:
    """Gauges made from the engine's latest `kv_stats()` when /metrics is scraped."""

    def __init__(self, kv_stats: Callable[[], dict]):
        self.kv_stats = kv_stats

    def collect(self):
        s = self.kv_stats()
        for name, help, key in (("llmlab_num_requests_running", "Requests with KV blocks on the device.", "num_running"),
                                ("llmlab_num_requests_waiting", "Requests queued for admission.", "num_waiting"),
                                ("llmlab_num_requests_swapped", "Requests preempted to host memory.", "num_swapped")):
            yield GaugeMetricFamily(name, help, value=s.get(key, 0))
        free = {"device": s.get("free_device_blocks", 0), "host": s.get("free_host_blocks", 0)}
        total = {"device": s.get("total_device_blocks", 0), "host": s.get("total_host_blocks", 0)}
        for name, help, values in (
                ("llmlab_kv_blocks_free", "Free KV blocks (evictable prefix-cache blocks count as free).", free),
                ("llmlab_kv_blocks_used", "KV blocks holding some request's keys and values.",
                 {where: total[where] - free[where] for where in total}),
                ("llmlab_kv_blocks_total", "KV blocks in the cache.", total)):
            gauge = GaugeMetricFamily(name, help, labels=["location"])
            for where, value in values.items():
                gauge.add_metric([where], value)
            yield gauge
        yield GaugeMetricFamily("llmlab_prefix_cache_hit_rate",
                                "Share of looked-up prompt blocks found in the prefix cache.",
                                value=s.get("prefix_hit_rate", 0.0))


class ServerMetrics:
    def __init__(self, kv_stats: Callable[[], dict] = dict):
        self.registry = registry = CollectorRegistry()
        registry.register(KVStatsCollector(kv_stats))
        self.prompt_tokens = Counter("llmlab_prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=registry)
        self.generation_tokens = Counter("llmlab_generation_tokens", "Output tokens generated.",
                                         registry=registry)
        self.requests_finished = Counter("llmlab_requests_finished", "Finished requests by finish reason.",
                                         ["finish_reason"], registry=registry)
        self.requests_rejected = Counter("llmlab_requests_rejected",
                                         "Requests answered with a client error (4xx), by status.",
                                         ["status"], registry=registry)
        self.requests_failed = Counter("llmlab_requests_failed",
                                       "Requests ended by a server error (5xx, also inside a stream), by status.",
                                       ["status"], registry=registry)
        self.preemptions = Counter("llmlab_num_preemptions",
                                   "Preemptions (swap or recompute), counted when the preempted request ends.",
                                   registry=registry)
        self.time_to_first_token = Histogram(
            "llmlab_time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "llmlab_inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
            buckets=INTER_TOKEN_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram(
            "llmlab_e2e_request_latency_seconds", "Time from arrival to the last output token.",
            buckets=E2E_BUCKETS, registry=registry)

    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new_tokens: int, since_arrival: float | None,
                  since_last_token: float | None) -> None:
        """`since_arrival` for a request's first token(s), else `since_last_token`."""
        self.generation_tokens.inc(num_new_tokens)
        if since_arrival is not None:
            self.time_to_first_token.observe(since_arrival)
        elif since_last_token is not None and num_new_tokens:
            for _ in range(num_new_tokens):
                self.inter_token_latency.observe(since_last_token / num_new_tokens)

    def on_finished(self, finish_reason: str, since_arrival: float, num_preemptions: int = 0) -> None:
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        self.e2e_request_latency.observe(since_arrival)
        if num_preemptions:
            self.preemptions.inc(num_preemptions)

    def on_error(self, status: int) -> None:
        """A request answered with an error: rejected (4xx) or failed (5xx)."""
        counter = self.requests_rejected if status < 500 else self.requests_failed
        counter.labels(status=str(status)).inc()

    def render(self) -> bytes:
        """The whole /metrics page, in Prometheus' text format."""
        return generate_latest(self.registry)
