"""The choice of worker: score each candidate by its probed queue, free KV cache and expected prefix hit.

Pure functions over `WorkerLoad` snapshots, so the rule can be tested without any server.
The scoring follows the Gateway API inference extension's endpoint picker: normalised queue
depth plus (1 - KV usage), saturated workers skipped unless every worker is saturated; prefix-aware
routing adds the share of the prompt each worker is expected to hold (gateway/prefix.py), counted only
for workers within a bounded load (consistent hashing with bounded loads, as KubeAI's PrefixHash), so a
hot prefix spreads once its holder carries more than its share.
"""

from __future__ import annotations

import math
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
    block_size: int = 0  # tokens per KV block, and the worker's KV blocks: 0 until its /load reports them
    num_blocks: int = 0

    @property
    def in_flight(self) -> int:
        """The load that bounded loads compare: everything the worker holds or is about to."""
        return self.waiting + self.running + self.unreflected

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
    # Prefix-aware: a worker expected to hold the whole prompt gains this much (2: a full hit outweighs a
    # one-request queue, whose term is 1 when the other queue is empty). 0 turns the term off.
    prefix_weight: float = 2.0
    # Bounded loads: a worker earns its prefix term only while (its load + 1) <= load_factor * the mean load
    # with this request counted. 1.25 is KubeAI's PrefixHash default.
    load_factor: float = 1.25
    # Scores this close to the best are a tie, broken at random so equal workers share a burst.
    tie_epsilon: float = 1e-6

    def __post_init__(self):
        if self.queue_threshold < 1:
            raise ValueError(f"queue_threshold must be >= 1, got {self.queue_threshold}")
        if not 0.0 < self.kv_threshold <= 1.0:
            raise ValueError(f"kv_threshold must be in (0, 1], got {self.kv_threshold}")
        if min(self.queue_weight, self.kv_weight, self.running_weight, self.prefix_weight) < 0:
            raise ValueError("routing weights must be >= 0")
        if self.queue_weight + self.kv_weight == 0:
            raise ValueError("queue_weight and kv_weight cannot both be 0")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")


@dataclass
class Decision:
    url: str
    # "best", "tie", "prefix" (chosen for its expected hit), "bounded" (the best holder was over its bound),
    # "all-saturated", "none-probed", "all-down"
    reason: str
    scores: dict[str, float] = field(default_factory=dict)


def is_saturated(load: WorkerLoad, policy: RoutingPolicy) -> bool:
    return load.queue_depth >= policy.queue_threshold or load.kv_cache_usage >= policy.kv_threshold


def within_bound(loads: list[WorkerLoad], load_factor: float) -> set[str]:
    """The workers that may take one more request for its prefix: (load + 1) <= load_factor * mean load,
    the mean counting this request. The fleet's least loaded worker is always within."""
    total = sum(w.in_flight for w in loads)
    if not loads or total == 0:
        return {w.url for w in loads}
    bound = load_factor * (total + 1) / len(loads)
    return {w.url for w in loads if w.in_flight + 1 <= math.ceil(bound)}


def scores(loads: list[WorkerLoad], policy: RoutingPolicy, hits: dict[str, float] | None = None) -> dict[str, float]:
    """Higher is better. Queue depth is normalised by the deepest queue among the candidates; `hits`
    (worker -> expected share of the prompt it holds) counts only for the workers given."""
    deepest = max((w.queue_depth for w in loads), default=0)
    out = {}
    for w in loads:
        queue_term = 1.0 - (w.queue_depth / deepest if deepest else 0.0)
        kv_term = 1.0 - min(max(w.kv_cache_usage, 0.0), 1.0)
        busy = min((w.running + w.unreflected) / w.max_num_seqs, 1.0) if w.max_num_seqs > 0 else 0.0
        prefix_term = (hits or {}).get(w.url, 0.0)
        out[w.url] = (policy.queue_weight * queue_term + policy.kv_weight * kv_term
                      + policy.running_weight * (1.0 - busy) + policy.prefix_weight * prefix_term)
    return out


def holding(loads: list[WorkerLoad], model: str) -> list[WorkerLoad]:
    """For a LoRA adapter's requests, the workers whose last probe lists the adapter. A base model, or an
    adapter that no worker reports yet (its pods just started; the operator's next pass loads it),
    keeps every worker."""
    holders = [w for w in loads if model in w.lora_adapters]
    return holders or loads


def choose(loads: list[WorkerLoad], policy: RoutingPolicy, rng: random.Random | None = None,
           hits: dict[str, float] | None = None, held: dict[str, int] | None = None) -> Decision:
    """Pick one worker among `loads` (the deployments LiteLLM still considers healthy); `hits` is the
    expected prefix hit on each (empty or None: queue-depth routing), `held` the blocks each is expected
    to cache: a tie over a prefix nobody holds goes to the worker holding least, so new conversations
    alternate between idle workers instead of landing at random."""
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
    hits = {u: h for u, h in (hits or {}).items() if h > 0.0}
    allowed = within_bound(up, policy.load_factor) if hits else set()
    table = scores(candidates, policy, {u: h for u, h in hits.items() if u in allowed})
    best = max(table.values())
    top = [w for w in candidates if table[w.url] >= best - policy.tie_epsilon]
    if len(top) > 1 and reason == "best":
        reason = "tie"
    if len(top) > 1 and held and not any(hits.get(w.url) for w in top):
        fewest = min(held.get(w.url, 0) for w in top)
        top = [w for w in top if held.get(w.url, 0) == fewest]
    url = rng.choice(top).url
    if reason in ("best", "tie") and hits:
        longest = max(hits.get(w.url, 0.0) for w in candidates)
        if hits.get(url, 0.0) >= longest:
            reason = "prefix"
        elif any(hits.get(w.url, 0.0) >= longest and w.url not in allowed for w in candidates):
            reason = "bounded"
    return Decision(url=url, reason=reason, scores=table)
