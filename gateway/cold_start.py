"""Cold starts: a request for a model whose workers scaled to zero waits here while one starts.

An InferenceService with `spec.autoscaling.minReplicas: 0` goes to 0 replicas when idle; its Service stays,
annotated `pagefleet.io/scale-to-zero` (membership.py reads it), so the gateway keeps its model groups. A
request for such a group while it has no ready worker is held in a bounded FIFO queue of that group
(`--cold-start-queue`), and the InferenceService is asked for one replica (membership.scale_from_zero,
through the scale subresource). The worker joining the group releases the held requests in arrival order;
past the queue's bound, or after `--cold-start-timeout-s`, the answer is 503 with `Retry-After`: the wait
is bounded, never a hang. A client that disconnects while held gives up its place.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagefleet.gateway.auth import API_PREFIXES

log = logging.getLogger("pagefleet.gateway.cold_start")

RELEASED, FULL, TIMED_OUT = "released", "queue-full", "timeout"


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale to zero (--kubernetes)")
    group.add_argument("--cold-start-timeout-s", type=_positive(float), default=120.0,
                       help="how long a request for a model scaled to zero waits for its first worker before a 503")
    group.add_argument("--cold-start-queue", type=_positive(int), default=64,
                       help="requests held per model group during its cold start; more get a 503 at once")


class ColdStarts:
    """Per model group: whether it can be woken, whether it has a worker, and the requests held for it.

    `wake(service)` asks for one replica of the InferenceService `service` (a coroutine). It is called for
    the first held request of a cold start and again every `rewake_s` while requests stay held, in case
    the first call failed or the operator scaled to zero again meanwhile; the call itself does nothing
    when the service already has replicas."""

    def __init__(self, timeout_s: float = 120.0, max_held: int = 64, rewake_s: float = 10.0,
                 wake: Callable[[str], Awaitable[None]] | None = None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0 or max_held < 1 or rewake_s <= 0:
            raise ValueError("cold-start timeout and rewake must be > 0 and the queue at least 1")
        self.timeout_s, self.max_held, self.rewake_s = timeout_s, max_held, rewake_s
        self.wake, self.clock = wake, clock
        self.wakeable: dict[str, str] = {}  # model group -> the InferenceService that scales to zero
        self.ready: set[str] = set()  # model groups with at least one worker
        self.held: dict[str, deque[asyncio.Future]] = {}
        self.cold_since: dict[str, float] = {}  # model group -> when its first request was held this time
        self.last_seconds: dict[str, float] = {}  # model group -> how long its last cold start took
        self._woken: dict[str, float] = {}  # service -> when it was last asked for a replica
        self._tasks: set[asyncio.Task] = set()
        registry = registry or CollectorRegistry()
        self.held_gauge = Gauge("pagefleet_gateway_cold_start_held", "Requests held for a model group with no worker",
                                ["model"], registry=registry)
        self.seconds_gauge = Gauge("pagefleet_gateway_cold_start_seconds",
                                   "First held request to first worker, of the last cold start", ["model"],
                                   registry=registry)
        self.refused = Counter("pagefleet_gateway_cold_start_refused", "Held requests answered 503",
                               ["model", "reason"], registry=registry)

    @classmethod
    def from_args(cls, args: argparse.Namespace, registry: CollectorRegistry | None = None) -> ColdStarts:
        return cls(timeout_s=args.cold_start_timeout_s, max_held=args.cold_start_queue, registry=registry)

    def is_cold(self, model: str) -> bool:
        return model in self.wakeable and model not in self.ready

    def any_cold(self) -> bool:
        return any(group not in self.ready for group in self.wakeable)

    def update(self, wakeable: Mapping[str, str] | None = None, ready: set[str] | None = None) -> None:
        """The membership's view changed; held requests of a group that is no longer cold go on, in order."""
        if wakeable is not None:
            self.wakeable = dict(wakeable)
        if ready is not None:
            self.ready = set(ready)
        for group in list(self.cold_since):
            if not self.is_cold(group):
                self._warm(group)

    def _warm(self, group: str) -> None:
        started = self.cold_since.pop(group)
        queue = self.held.pop(group, deque())
        if group in self.ready:
            self.last_seconds[group] = seconds = self.clock() - started
            self.seconds_gauge.labels(group).set(seconds)
            log.info("model %s: first worker ready %.1fs after the first held request; releasing %d held",
                     group, seconds, len(queue))
        for waiter in queue:  # FIFO: the first held goes on first
            if not waiter.done():
                waiter.set_result(RELEASED)
        self.held_gauge.labels(group).set(0)

    def retry_after(self, group: str) -> int:
        """Seconds a refused client should wait: what is left of the last cold start's time (the timeout
        before one has been measured), at least 1."""
        expected = self.last_seconds.get(group, self.timeout_s)
        elapsed = self.clock() - self.cold_since[group] if group in self.cold_since else 0.0
        return max(1, math.ceil(expected - elapsed))

    async def hold(self, group: str) -> str:
        """Waits until `group` has a worker (RELEASED), or answers FULL or TIMED_OUT."""
        if not self.is_cold(group):
            return RELEASED
        queue = self.held.setdefault(group, deque())
        self.cold_since.setdefault(group, self.clock())
        if len(queue) >= self.max_held:
            self.refused.labels(group, FULL).inc()
            return FULL
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self.held_gauge.labels(group).set(len(queue))
        deadline = self.clock() + self.timeout_s
        try:
            while True:
                self._wake(group)
                left = deadline - self.clock()
                if left <= 0:
                    self.refused.labels(group, TIMED_OUT).inc()
                    return TIMED_OUT
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter), min(left, self.rewake_s))
                except asyncio.TimeoutError:
                    continue
        finally:
            if waiter in queue:
                queue.remove(waiter)
                self.held_gauge.labels(group).set(len(queue))

    def _wake(self, group: str) -> None:
        service = self.wakeable.get(group)
        if service is None or self.wake is None:
            return
        now = self.clock()
        if now - self._woken.get(service, -math.inf) < self.rewake_s:
            return
        self._woken[service] = now
        task = asyncio.get_running_loop().create_task(self._call_wake(group, service))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    async def _call_wake(self, group: str, service: str) -> None:
        try:
            await self.wake(service)
        except Exception as exc:  # the API server is down, RBAC is missing: the next rewake tries again
            log.warning("model %s: could not scale %s from zero: %s", group, service, exc)


class ColdStartHold:
    """ASGI wrapper: holds an API request for a cold model group until its worker is up (or answers 503).

    It reads the body only while some group is cold (the `model` is in it), then hands LiteLLM the same
    messages; with every group warm a request passes straight through."""

    def __init__(self, app, cold_starts: ColdStarts):
        self.app = app
        self.cold = cold_starts

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith(API_PREFIXES)
                or not self.cold.any_cold()):
            await self.app(scope, receive, send)
            return
        messages = await _read_body(receive)
        model = _model_of(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"))

        async def replay():
            return messages.pop(0) if messages else await receive()

        if model is None or not self.cold.is_cold(model):
            await self.app(scope, replay, send)
            return
        hold = asyncio.ensure_future(self.cold.hold(model))
        listen = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({hold, listen}, return_when=asyncio.FIRST_COMPLETED)
        if listen in done:  # after the whole body only http.disconnect comes: the client left, its place goes
            hold.cancel()
            await asyncio.gather(hold, return_exceptions=True)
            return
        listen.cancel()
        await asyncio.gather(listen, return_exceptions=True)
        outcome = hold.result()
        if outcome == RELEASED:
            await self.app(scope, replay, send)
            return
        await _unavailable(send, model, outcome, self.cold)


async def _read_body(receive) -> list[dict]:
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body"):
            return messages


def _model_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


async def _unavailable(send, model: str, outcome: str, cold: ColdStarts) -> None:
    why = (f"more than {cold.max_held} requests are waiting" if outcome == FULL
           else f"no worker became ready within {cold.timeout_s:g}s")
    body = json.dumps({"error": {
        "message": f"Model {model!r} is starting from zero replicas and {why}; retry later.",
        "type": "service_unavailable", "param": None, "code": "503"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(cold.retry_after(model)).encode())]})
    await send({"type": "http.response.body", "body": body})
