"""Scale to zero: when an idle InferenceService goes to 0 replicas, and the probe that tells idle from busy.

With `spec.autoscaling.minReplicas: 0`, an InferenceService whose ready workers have run no request for
`scaleToZeroAfterSeconds` goes to 0 replicas. A queue read at one probe cannot tell idle from busy (a
request that comes and goes between two probes leaves no trace in it), so the probe also reads the engine's
step counter from `/metrics` (`pagefleet:engine_steps_total`): an engine with no request takes no step, and
every request moves it. `decide` is pure (the clock and the idle start come in as arguments), as
autoscaler.decide is. Waking is not decided here: the gateway holds a request for a model with no worker and
sets spec.replicas to 1 through the scale subresource (gateway/cold_start.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagefleet.operator.autoscaler import get_each

SCALED_TO_ZERO = "ScaledToZero"
SCALED_FROM_ZERO = "ScaledFromZero"
ACTIVE, NO_TRAFFIC, NO_SAMPLE, AT_ZERO = "Active", "NoTraffic", "NoActivitySample", "AtZero"
# The worker's /metrics series the probe reads (worker/entrypoints/metrics.py).
_SERIES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "pagefleet:engine_steps_total": "steps"}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)", re.M)


def enabled(spec: Mapping[str, Any]) -> bool:
    """Scale to zero is on when autoscaling allows 0 replicas (the CRD then requires scaleToZeroAfterSeconds)."""
    autoscaling = spec.get("autoscaling") or {}
    return bool(autoscaling) and int(autoscaling.get("minReplicas", 1)) == 0


@dataclass(frozen=True)
class Sample:
    """One worker's requests now and its engine's steps so far."""

    waiting: int
    running: int
    steps: int


def activity(samples: Mapping[str, Sample], seen: Mapping[str, int]) -> bool | None:
    """Whether any worker ran a request since the previous pass: it has one now, or its step counter moved
    from `seen` (worker URL -> steps at the previous pass; a worker seen for the first time has nothing to
    compare with). None when no worker answered: then nothing is known."""
    if not samples:
        return None
    return any(s.waiting or s.running or (url in seen and s.steps != seen[url]) for url, s in samples.items())


@dataclass(frozen=True)
class IdleDecision:
    replicas: int  # 0 when scaling to zero, else the current replicas
    idle_since: float | None  # since when no request has run (seconds, same clock as `now`)
    reason: str  # ScaledToZero, NoTraffic, Active, NoActivitySample
    message: str


def decide(*, current: int, active: bool | None, after: float, now: float, idle_since: float | None) -> IdleDecision:
    """One idle step: zero replicas once no request has run for `after` seconds (`idle_since` carries the
    start between calls). A pass without a sample (workers loading or not answering) leaves the clock as
    it is: a worker that has just started from zero begins counting at its first answered probe."""
    if active is None:
        return IdleDecision(current, idle_since, NO_SAMPLE, "no ready worker answered /metrics; idle clock unchanged")
    if active:
        return IdleDecision(current, None, ACTIVE,
                            f"requests ran since the last probe; scales to zero after {after:g}s without any")
    since = now if idle_since is None else idle_since
    waited = now - since
    if waited >= after:
        return IdleDecision(0, None, SCALED_TO_ZERO, f"no request for {waited:.0f}s (scaleToZeroAfterSeconds "
                                                     f"{after:g}): replicas {current} -> 0")
    return IdleDecision(current, since, NO_TRAFFIC,
                        f"no request for {waited:.0f}s; scaling to zero after {after - waited:.0f}s more")


def parse_metrics(text: str) -> Sample:
    """The three series from a worker's Prometheus text (labels summed over)."""
    found: dict[str, float] = {}
    for name, value in _LINE.findall(text):
        if name in _SERIES:
            found[_SERIES[name]] = found.get(_SERIES[name], 0.0) + float(value)
    if "steps" not in found:
        raise ValueError("no pagefleet:engine_steps_total in /metrics")
    return Sample(int(found.get("waiting", 0)), int(found.get("running", 0)), int(found["steps"]))


async def probe(endpoints: Iterable[str], timeout: float = 2.0) -> dict[str, Sample]:
    """GET {endpoint}/metrics of each ready pod at once; endpoint -> Sample for those that answered."""
    return await get_each(endpoints, "/metrics", lambda answer: parse_metrics(answer.text), timeout)
