"""Queue-depth autoscaling: how many workers keep the waiting requests per ready pod near the target.

`decide` is pure (the clock and the last low-load time come in as arguments); `probe_waiting` reads
each ready pod's `/load`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx

T = TypeVar("T")

SCALE_UP = "ScaledUp"
SCALE_DOWN = "ScaledDown"


@dataclass(frozen=True)
class Decision:
    replicas: int  # the replicas to run from now on
    current: int  # the replicas before this decision
    average: float | None  # waiting requests per probed pod (None: no pod answered)
    needed: int  # replicas the load calls for, within [min, max]
    low_since: float | None  # since when the load has called for fewer replicas (seconds, same clock as `now`)
    reason: str  # ScaledUp, ScaledDown, or why nothing changed
    message: str

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def decide(
    *,
    current: int,
    waiting: Sequence[int],
    target: float,
    min_replicas: int,
    max_replicas: int,
    scale_down_delay: float,
    now: float,
    low_since: float | None,
) -> Decision:
    """One autoscaling step.

    `waiting` has one entry per ready pod that answered its /load probe. The load calls for
    ceil(total waiting / target) replicas, kept within [min_replicas, max_replicas]. More than
    `current` scales up at once; fewer scales down only once the load has called for fewer
    continuously for `scale_down_delay` seconds (`low_since` carries that start between calls).
    """
    bounded = max(min_replicas, min(max_replicas, current))
    if not waiting:
        # Nothing to measure (pods still loading, or none answered): only enforce the bounds.
        reason = _reason(bounded, current, "NoLoadSample")
        return Decision(bounded, current, None, bounded, None, reason,
                        f"no ready pod answered /load; replicas {current} -> {bounded} "
                        f"(bounds [{min_replicas}, {max_replicas}])"
                        if bounded != current else "no ready pod answered /load; holding")
    total = sum(waiting)
    average = total / len(waiting)
    needed = max(min_replicas, min(max_replicas, math.ceil(total / target)))
    load = f"average queue depth {average:.2f} over {len(waiting)} pod(s) (target {target:g})"
    if bounded != current or needed > current:
        # Outside the bounds (they were just edited) or too few for the load: act at once.
        replicas = max(needed, bounded)
        return Decision(replicas, current, average, needed, None, _reason(replicas, current, "AtTarget"),
                        f"{load}: replicas {current} -> {replicas}")
    if needed == current:
        return Decision(current, current, average, needed, None, "AtTarget", f"{load}: holding {current}")
    # The load calls for fewer replicas.
    since = now if low_since is None else low_since
    waited = now - since
    if waited >= scale_down_delay:
        return Decision(needed, current, average, needed, None, SCALE_DOWN,
                        f"{load}, low for {waited:.0f}s >= {scale_down_delay:g}s: replicas {current} -> {needed}")
    return Decision(current, current, average, needed, since, "LowLoad",
                    f"{load}: {needed} would do; scaling down after {scale_down_delay - waited:.0f}s more of low load")


def _reason(replicas: int, current: int, same: str) -> str:
    if replicas > current:
        return SCALE_UP
    if replicas < current:
        return SCALE_DOWN
    return same


async def get_each(endpoints: Iterable[str], path: str, parse: Callable[[httpx.Response], T],
                   timeout: float = 2.0) -> dict[str, T]:
    """GET {endpoint}{path} of each pod at once; endpoint -> parse(answer) for those that answered 200 with
    something parse accepts (it raises ValueError, KeyError or TypeError for what it does not)."""
    endpoints = list(endpoints)
    # Pod IPs are reached directly, never through a proxy from the environment.
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        answers = await asyncio.gather(*(client.get(f"{url}{path}") for url in endpoints), return_exceptions=True)
    parsed: dict[str, T] = {}
    for url, answer in zip(endpoints, answers, strict=True):
        if isinstance(answer, BaseException) or answer.status_code != 200:
            continue
        try:
            parsed[url] = parse(answer)
        except (ValueError, KeyError, TypeError):
            continue
    return parsed


async def probe_waiting(endpoints: Iterable[str], timeout: float = 2.0) -> dict[str, int]:
    """GET {endpoint}/load of each pod at once; returns endpoint -> waiting requests for those that answered."""
    return await get_each(endpoints, "/load", lambda answer: int(answer.json()["waiting"]), timeout)
