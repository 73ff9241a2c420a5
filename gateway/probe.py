"""The background prober: asks every worker's `/load` every few hundred milliseconds.

It keeps, per worker, the last answer (waiting, running, KV usage) and our own count of the
requests sent to it since the probe that last answered was issued: those are not in the
worker's queue yet, and without them a burst between two probes would all land on one worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from pagefleet.gateway.routing import WorkerLoad

log = logging.getLogger("pagefleet.gateway.probe")


class GatewayMetrics:
    """Our own Prometheus series, in a registry of their own (LiteLLM keeps its own)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        label, r = ["worker"], self.registry
        self.waiting = Gauge("pagefleet_gateway_worker_waiting", "Last probed waiting requests", label, registry=r)
        self.running = Gauge("pagefleet_gateway_worker_running", "Last probed running requests", label, registry=r)
        self.kv = Gauge("pagefleet_gateway_worker_kv_cache_usage", "Last probed KV cache usage (0-1)", label,
                        registry=r)
        self.queue = Gauge("pagefleet_gateway_worker_queue_depth", "Probed waiting plus requests sent since the probe",
                           label, registry=r)
        self.up = Gauge("pagefleet_gateway_worker_up", "1 if the worker's last probe answered", label, registry=r)
        self.probe_failures = Counter("pagefleet_gateway_probe_failures_total", "Failed /load probes", label,
                                      registry=r)
        self.prefix_queried = Counter("pagefleet_gateway_prefix_query_blocks_total",
                                      "Prompt blocks of requests routed by prefix", label, registry=r)
        self.prefix_expected = Counter("pagefleet_gateway_prefix_expected_hit_blocks_total",
                                       "Of those, blocks the chosen worker was expected to hold", label, registry=r)
        self.decisions = Counter("pagefleet_gateway_routing_decisions_total",
                                 "Routing decisions by chosen worker and reason", ["worker", "reason"], registry=r)

    def forget(self, url: str) -> None:
        for gauge in (self.waiting, self.running, self.kv, self.queue, self.up, self.prefix_queried,
                      self.prefix_expected):
            try:
                gauge.remove(url)
            except KeyError:
                pass


class Prober:
    def __init__(self, interval_s: float = 0.2, timeout_s: float = 1.0, metrics: GatewayMetrics | None = None,
                 headers: dict[str, str] | None = None):
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("probe interval and timeout must be > 0")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.metrics = metrics or GatewayMetrics()
        self.headers = headers or {}
        self.loads: dict[str, WorkerLoad] = {}
        self._sent: dict[str, deque[float]] = {}  # per worker, monotonic times of sends not yet reflected
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    # membership
    def add(self, url: str) -> None:
        if url not in self.loads:
            self.loads[url] = WorkerLoad(url=url)
            self._sent[url] = deque()

    def remove(self, url: str) -> None:
        self.loads.pop(url, None)
        self._sent.pop(url, None)
        self.metrics.forget(url)

    # what the router tells us
    def note_sent(self, url: str) -> None:
        if url in self.loads:
            self._sent[url].append(time.monotonic())
            self.loads[url].unreflected = len(self._sent[url])
            self.metrics.queue.labels(url).set(self.loads[url].queue_depth)

    def note_failed(self, url: str) -> None:
        """A request to this worker failed to connect: out until its next probe answers."""
        if url in self.loads:
            self.loads[url].up = False
            self.metrics.up.labels(url).set(0)

    def snapshot(self, url: str) -> WorkerLoad | None:
        return self.loads.get(url)

    # probing
    async def probe_once(self, url: str) -> None:
        issued = time.monotonic()
        try:
            resp = await self._client.get(f"{url}/load", timeout=self.timeout_s, headers=self.headers)
            resp.raise_for_status()
            body = resp.json()
            waiting, running = int(body["waiting"]), int(body["running"])
            kv, max_seqs = float(body["kv_cache_usage"]), int(body.get("max_num_seqs", 0))
            adapters = frozenset(body.get("lora_adapters") or ())
            # The prefix index's block size and LRU bound; 0 from a worker that does not report them.
            block_size, num_blocks = int(body.get("block_size", 0)), int(body.get("num_blocks", 0))
            if body.get("draining"):  # answers its probe but refuses new work with 503
                raise RuntimeError("draining")
        except Exception as exc:  # connection refused, timeout, bad JSON, draining: all mean "not usable now"
            load = self.loads.get(url)
            if load is not None:
                if load.up is not False:
                    log.warning("worker %s failed its probe: %s", url, exc)
                load.up = False
                self.metrics.up.labels(url).set(0)
                self.metrics.probe_failures.labels(url).inc()
            return
        load = self.loads.get(url)
        if load is None:  # removed while the probe was in flight
            return
        if load.up is False:
            log.info("worker %s answers its probe again", url)
        sent = self._sent[url]
        while sent and sent[0] <= issued:  # sent before the probe left: the worker's answer counts them
            sent.popleft()
        load.waiting, load.running, load.kv_cache_usage, load.max_num_seqs = waiting, running, kv, max_seqs
        load.unreflected, load.up, load.lora_adapters = len(sent), True, adapters
        load.block_size, load.num_blocks = block_size, num_blocks
        m = self.metrics
        m.waiting.labels(url).set(waiting)
        m.running.labels(url).set(running)
        m.kv.labels(url).set(kv)
        m.queue.labels(url).set(load.queue_depth)
        m.up.labels(url).set(1)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe_once(url) for url in list(self.loads)))

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.probe_all()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="pagefleet-prober")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client:
            await self._client.aclose()
