"""The choice of worker: score each candidate by its probed queue depth and free KV cache.

Pure functions over `WorkerLoad` snapshots, so the rule can be tested without any server.
The scoring follows the Gateway API inference extension's endpoint picker: normalised queue
depth plus (1 - KV usage), saturated workers skipped unless every worker is saturated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    """What the gateway knows of one worker: its last `/load` answer plus our own unreflected sends."""

    url: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    max_num_seqs: int = 0
    # None: never probed yet; True: last probe answered; False: last probe failed (out until it answers).
    up: bool | None = None
    # Requests we sent after the last probe was issued: the worker's queue does not show them yet.
    unreflected: int = 0
    lora_adapters: frozenset[str] = frozenset()  # the LoRA adapters the worker holds now

    @property
    def queue_depth(self) -> int:
        """Requests that would wait before a newcomer runs: the probed queue, plus those of our
        unreflected sends that do not fit in the batch slots the probe saw free."""
        free_slots = max(0, self.max_num_seqs - self.running) if self.max_num_seqs > 0 else 0
        return self.waiting + max(0, self.unreflected - free_slots)


@dataclass(frozen=True)
class RoutingPolicy:
    queue_threshold: int = 5  # a worker with this many queued requests is saturated
    kv_threshold: float = 0.8  # ... or with this fraction of its KV cache in use
    queue_weight: float = 1.0
    kv_weight: float = 1.0
    # Small: among workers with equally short queues, prefer the one with free batch slots.
    running_weight: float = 0.05
    # Scores this close to the best are a tie, broken at random so equal workers share a burst.
    tie_epsilon: float = 1e-6

    def __post_init__(self):
        if self.queue_threshold < 1:
            raise ValueError(f"queue_threshold must be >= 1, got {self.queue_threshold}")
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if min(self.queue_weight, self.kv_weight, self.running_weight) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.queue_weight + self.kv_weight == 0:
            raise ValueError("queue_weight and kv_weight cannot both be 0")


@dataclass
class Decision:
    url: str
    reason: str  # "best", "tie", "all-saturated", "none-probed", "all-down"
    scores: dict[str, float] = field(default_factory=dict)


def is_saturated(load: WorkerLoad, policy: RoutingPolicy) -> bool:
    return load.queue_depth >= policy.queue_threshold or load.kv_cache_usage >= policy.kv_threshold


def scores(loads: list[WorkerLoad], policy: RoutingPolicy) -> dict[str, float]:
    """Higher is better. Queue depth is normalised by the deepest queue among the candidates."""
    deepest = max((w.queue_depth for w in loads), default=0)
    out = {}
    for w in loads:
        queue_term = 1.0 - (w.queue_depth / deepest if deepest else 0.0)
        kv_term = 1.0 - min(max(w.kv_cache_usage, 0.0), 1.0)
        busy = min((w.running + w.unreflected) / w.max_num_seqs, 1.0) if w.max_num_seqs > 0 else 0.0
        out[w.url] = policy.queue_weight * queue_term + policy.kv_weight * kv_term + policy.running_weight * (1.0 - busy)
    return out


def holding(loads: list[WorkerLoad], model: str) -> list[WorkerLoad]:
    """For a LoRA adapter's requests, the workers whose last probe lists the adapter. A base model, or an
    adapter that no worker reports yet (its pods just started; the operator's next pass loads it),
    keeps every worker."""
    holders = [w for w in loads if model in w.lora_adapters]
    return holders or loads


def choose(loads: list[WorkerLoad], policy: RoutingPolicy, rng: random.Random | None = None) -> Decision:
    """Pick one worker among `loads` (the deployments LiteLLM still considers healthy)."""
    if not loads:
        raise ValueError("no candidate workers")
    rng = rng or random
    up = [w for w in loads if w.up is True]
    reason = "best"
    if not up:
        # Nothing answered its last probe. Workers never probed yet (just joined) come first;
        # if every worker failed its probe, try any: LiteLLM retries another on failure.
        up = [w for w in loads if w.up is None]
        reason = "none-probed" if up else "all-down"
        up = up or list(loads)
    candidates = [w for w in up if not is_saturated(w, policy)]
    if not candidates:
        candidates, reason = up, "all-saturated"
    table = scores(candidates, policy)
    best = max(table.values())
    top = [w for w in candidates if table[w.url] >= best - policy.tie_epsilon]
    if len(top) > 1 and reason == "best":
        reason = "tie"
    return Decision(url=rng.choice(top).url, reason=reason, scores=table)
