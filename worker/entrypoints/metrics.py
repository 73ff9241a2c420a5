"""Prometheus metrics under vLLM's names, so existing routers and dashboards read a pagefleet worker as-is.

Engine state (queues, KV usage, token and prefix-cache counters) is read from `engine.stats()` at scrape
time by a collector, so nothing is double-counted and a scrape costs one call. Latencies are measured
in the server from the stream each client sees: time to first token, gaps between tokens, end to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series, as vLLM: half the lines for every scraper to skip

# vLLM's bucket edges, extended downwards: an H200 decodes a token in ~5 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and counters that the engine already keeps; read once per scrape."""

    def __init__(self, model_name: str, stats: Callable[[], object]):
        self.model_name, self.stats = model_name, stats

    def describe(self):
        return []  # no registration-time collect(): the engine may not be loaded yet

    def collect(self):
        s = self.stats()
        if s is None:
            return
        label = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, float(value))
            return g

        def counter(name, doc, value):  # prometheus_client appends the _total suffix
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", s.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hits_total)
        yield counter("pagefleet:engine_steps", "Engine steps run.", s.steps_total)
        yield counter("pagefleet:jump_forward_tokens", "Generation tokens a grammar forced and the engine appended "
                      "without drawing them (--structured-outputs-jump-forward).", s.jump_forward_tokens_total)
        if getattr(s, "max_loras", 0):
            # vLLM's shape, which LoRA-aware routers read: the adapters in the labels, the scrape time as value
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            g.add_metric([str(s.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras)], time.time())
            yield g


class ServerMetrics:
    """One registry per app (not the process-global one), so several apps can live in one process."""

    def __init__(self, model_name: str, stats: Callable[[], object]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                              buckets=TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Latency between output tokens in seconds.",
                             buckets=ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             buckets=E2E_BUCKETS, **kw).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully finished requests.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter("pagefleet:requests_rejected", "Requests refused before reaching the engine.",
                                 labelnames=["model_name", "reason"], registry=self.registry)
        self.model_name = model_name

    def cache_config(self, block_size: int, num_gpu_blocks: int, cache_dtype: str) -> None:
        """vLLM's vllm:cache_config_info: the KV cache's settings as labels of a gauge at 1, which capacity
        dashboards read (num_gpu_blocks x block_size tokens, in cache_dtype: auto or fp8)."""
        info = {"model_name": self.model_name, "block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks),
                "cache_dtype": cache_dtype}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labelnames=list(info),
              registry=self.registry).labels(**info).set(1)

    def request_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self.model_name, finish_reason or "abort").inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
