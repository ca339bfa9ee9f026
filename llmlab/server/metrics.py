"""Server metrics in the Prometheus text format (written by hand: it is a few lines).

The engine thread is the only writer (it sees every token as it is sampled); `/metrics`
reads. Gauges (queue lengths, KV blocks) come from the engine's latest `kv_stats()`;
counters and histograms accumulate here. Names follow vLLM's where one exists, so a
Grafana dashboard for one reads the other with a prefix change.
"""
from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)    # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count     # Prometheus buckets are cumulative: value <= le
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()    # so a scrape never sees half of an update
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}    # finish reason -> requests
        self.time_to_first_token = Histogram(
            "llmlab_time_to_first_token_seconds", "Time from arrival to the first output token.",
            TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "llmlab_inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
            INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = Histogram(
            "llmlab_e2e_request_latency_seconds", "Time from arrival to the last output token.",
            E2E_BUCKETS)

    def on_added(self, num_prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += num_prompt_tokens

    def on_tokens(self, num_new_tokens: int, since_arrival: float | None,
                  since_last_token: float | None) -> None:
        """`since_arrival` for a request's first token(s), else `since_last_token`."""
        with self.lock:
            self.generation_tokens += num_new_tokens
            if since_arrival is not None:
                self.time_to_first_token.observe(since_arrival)
            elif since_last_token is not None and num_new_tokens:
                for _ in range(num_new_tokens):
                    self.inter_token_latency.observe(since_last_token / num_new_tokens)

    def on_finished(self, finish_reason: str, since_arrival: float) -> None:
        with self.lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.e2e_request_latency.observe(since_arrival)

    def render(self, kv_stats: dict) -> str:
        """The whole /metrics page; `kv_stats` is the engine's latest `kv_stats()`."""
        def metric(name, kind, help, samples):
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        s = kv_stats
        lines: list[str] = []
        metric("llmlab_num_requests_running", "gauge", "Requests with KV blocks on the device.",
               [("", s.get("num_running", 0))])
        metric("llmlab_num_requests_waiting", "gauge", "Requests queued for admission.",
               [("", s.get("num_waiting", 0))])
        metric("llmlab_num_requests_swapped", "gauge", "Requests preempted to host memory.",
               [("", s.get("num_swapped", 0))])
        free, total = s.get("free_device_blocks", 0), s.get("total_device_blocks", 0)
        free_host, total_host = s.get("free_host_blocks", 0), s.get("total_host_blocks", 0)
        metric("llmlab_kv_blocks_free", "gauge", "Free KV blocks (evictable prefix-cache blocks count as free).",
               [('{location="device"}', free), ('{location="host"}', free_host)])
        metric("llmlab_kv_blocks_used", "gauge", "KV blocks holding some request's keys and values.",
               [('{location="device"}', total - free), ('{location="host"}', total_host - free_host)])
        metric("llmlab_kv_blocks_total", "gauge", "KV blocks in the cache.",
               [('{location="device"}', total), ('{location="host"}', total_host)])
        metric("llmlab_prefix_cache_hit_rate", "gauge", "Share of looked-up prompt blocks found in the prefix cache.",
               [("", s.get("prefix_hit_rate", 0.0))])
        with self.lock:
            metric("llmlab_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [("", self.prompt_tokens)])
            metric("llmlab_generation_tokens_total", "counter", "Output tokens generated.",
                   [("", self.generation_tokens)])
            metric("llmlab_requests_finished_total", "counter", "Finished requests by finish reason.",
                   [(f'{{finish_reason="{reason}"}}', n) for reason, n in sorted(self.finished.items())])
            for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency):
                lines.extend(histogram.render())
        return "\n".join(lines) + "\n"
