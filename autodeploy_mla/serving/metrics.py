"""Serving metrics in Prometheus format (prometheus_client), one registry per server.

A registry per `ServingMetrics` rather than the library's process-global default: two servers (or
a server and the tests) in one process keep their own numbers.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds: TTFT spans prefill of long prompts; inter-token latency one decode step.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class ServingMetrics:
    def __init__(self, window_s: float = 10.0) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("autodeploy_requests_running", "requests admitted to the batch", registry=r)
        self.waiting = Gauge("autodeploy_requests_waiting", "requests queued for admission", registry=r)
        self.pages_used = Gauge("autodeploy_cache_pages_used", "paged-cache pages held by requests", registry=r)
        self.pages_total = Gauge("autodeploy_cache_pages_total", "usable paged-cache pages", registry=r)
        self.tokens_per_s = Gauge("autodeploy_generation_tokens_per_second",
                                  f"generated tokens per second over the last {window_s:g} s", registry=r)
        self.generated = Counter("autodeploy_generation_tokens", "generated tokens", registry=r)
        self.prompt = Counter("autodeploy_prompt_tokens", "prompt tokens of the requests submitted", registry=r)
        # vLLM's pair (prefix_cache_queries / prefix_cache_hits): hit rate = hits / queries over a window
        self.prefix_queries = Counter("autodeploy_prefix_cache_query_tokens",
                                      "prompt tokens looked up in the prefix cache (requests admitted)", registry=r)
        self.prefix_hits = Counter("autodeploy_prefix_cache_hit_tokens",
                                   "prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.pages_cached = Gauge("autodeploy_cache_pages_cached",
                                  "paged-cache pages holding a cached prefix (held or evictable)", registry=r)
        self.finished = Counter("autodeploy_requests_finished", "finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("autodeploy_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("autodeploy_inter_token_latency_seconds", "time between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("autodeploy_request_latency_seconds", "time from arrival to the last token",
                             buckets=TTFT_BUCKETS, registry=r)
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()

    def tokens(self, n: int, now: float) -> None:
        """Record `n` new tokens at `now` (monotonic seconds) and refresh the tokens/s gauge."""
        if n:
            self.generated.inc(n)
            self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()
        self.tokens_per_s.set(sum(c for _, c in self._recent) / self._window_s)

    def engine_totals(self, queries: int, hits: int, seen: tuple[int, int]) -> tuple[int, int]:
        """Advance the prefix-cache counters to the engine's running totals (`seen`: the totals at
        the last call); returns the new `seen`."""
        if queries > seen[0]:
            self.prefix_queries.inc(queries - seen[0])
        if hits > seen[1]:
            self.prefix_hits.inc(hits - seen[1])
        return max(queries, seen[0]), max(hits, seen[1])

    def render(self) -> bytes:
        self.tokens(0, time.monotonic())
        return generate_latest(self.registry)
