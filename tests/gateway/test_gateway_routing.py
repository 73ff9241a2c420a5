"""The choice of worker (gateway/routing.py): pure scoring, no servers."""

import random
from collections import Counter

import pytest

from pagefleet.gateway.routing import RoutingPolicy, WorkerLoad, choose, holding, is_saturated, scores, within_bound

POLICY = RoutingPolicy()


def load(url, waiting=0, running=0, kv=0.0, max_num_seqs=4, up=True, unreflected=0):
    return WorkerLoad(url=url, waiting=waiting, running=running, kv_cache_usage=kv, max_num_seqs=max_num_seqs,
                      up=up, unreflected=unreflected)


def test_shorter_queue_wins():
    d = choose([load("a", waiting=3, running=4), load("b", waiting=0, running=1)], POLICY, random.Random(0))
    assert d.url == "b" and d.reason == "best"


def test_free_kv_cache_breaks_equal_queues():
    d = choose([load("a", kv=0.5), load("b", kv=0.1)], POLICY, random.Random(0))
    assert d.url == "b"


def test_equal_workers_tie_and_share_at_random():
    rng = random.Random(1)
    picks = Counter(choose([load("a"), load("b"), load("c")], POLICY, rng).url for _ in range(300))
    assert set(picks) == {"a", "b", "c"}
    assert min(picks.values()) > 60  # roughly a third each, not always the first


def test_saturated_worker_is_skipped_even_if_its_score_would_win():
    # "a" has an empty queue but a full KV cache; "b" has a short queue and room.
    a, b = load("a", kv=0.85), load("b", waiting=2, running=4, kv=0.0)
    assert is_saturated(a, POLICY) and not is_saturated(b, POLICY)
    assert choose([a, b], POLICY).url == "b"


def test_queue_threshold_saturates():
    assert is_saturated(load("a", waiting=5, running=4), POLICY)
    assert not is_saturated(load("a", waiting=4, running=4), POLICY)
    assert is_saturated(load("a", waiting=2, running=4), RoutingPolicy(queue_threshold=2))


def test_all_saturated_still_picks_the_least_loaded():
    d = choose([load("a", waiting=9, running=4), load("b", waiting=6, running=4)], POLICY)
    assert d.url == "b" and d.reason == "all-saturated"


def test_down_worker_is_out_while_another_answers():
    picks = {choose([load("a", up=False), load("b", waiting=4, running=4)], POLICY).url for _ in range(50)}
    assert picks == {"b"}


def test_never_probed_workers_are_used_when_none_answered_yet():
    d = choose([load("a", up=None), load("b", up=False)], POLICY)
    assert d.url == "a" and d.reason == "none-probed"


def test_all_down_still_returns_one_so_litellm_can_retry():
    d = choose([load("a", up=False), load("b", up=False)], POLICY)
    assert d.url in {"a", "b"} and d.reason == "all-down"


def test_unreflected_sends_fill_free_slots_before_they_count_as_queue():
    w = load("a", running=1, max_num_seqs=4, unreflected=3)
    assert w.queue_depth == 0
    w.unreflected = 5
    assert w.queue_depth == 2
    assert load("b", waiting=1, running=4, unreflected=2).queue_depth == 3


def test_a_burst_between_probes_spreads_over_idle_workers():
    """Without the unreflected count every request of a burst would see the same probe and pick alike."""
    loads = [load("a", max_num_seqs=2), load("b", max_num_seqs=2)]
    rng = random.Random(0)
    for _ in range(8):
        d = choose(loads, POLICY, rng)
        next(w for w in loads if w.url == d.url).unreflected += 1
    assert [w.unreflected for w in loads] == [4, 4]


def test_a_burst_avoids_a_worker_with_a_long_queue():
    busy, idle = load("busy", waiting=6, running=2, max_num_seqs=2), load("idle", max_num_seqs=2)
    rng = random.Random(0)
    for _ in range(8):
        d = choose([busy, idle], POLICY, rng)
        (idle if d.url == "idle" else busy).unreflected += 1
    assert idle.unreflected == 8 and busy.unreflected == 0


def test_scores_are_normalised_by_the_deepest_queue():
    s = scores([load("a", waiting=4, running=4), load("b", waiting=2, running=4), load("c", running=4)], POLICY)
    assert s["a"] < s["b"] < s["c"]
    assert s["c"] - s["a"] == pytest.approx(POLICY.queue_weight)


@pytest.mark.parametrize("kwargs", [dict(queue_threshold=0), dict(kv_threshold=0.0), dict(kv_threshold=1.5),
                                    dict(queue_weight=-1), dict(queue_weight=0, kv_weight=0)])
def test_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        RoutingPolicy(**kwargs)


def test_no_candidates_is_a_clear_error():
    with pytest.raises(ValueError, match="no candidate"):
        choose([], POLICY)


def test_an_adapter_goes_only_to_workers_that_hold_it():
    idle = load("a")  # the least loaded, but the operator has not loaded "sql" into it yet
    busy = WorkerLoad(url="b", waiting=2, running=4, max_num_seqs=4, up=True, lora_adapters=frozenset({"sql"}))
    assert holding([idle, busy], "sql") == [busy]
    assert choose(holding([idle, busy], "sql"), POLICY, random.Random(0)).url == "b"
    # the base model, or an adapter no worker reports yet: every worker stays a candidate
    assert holding([idle, busy], "smollm2") == [idle, busy] and holding([idle, busy], "new") == [idle, busy]


# ---- prefix-aware: the expected hit as a term, bounded loads


def test_the_worker_holding_the_prefix_wins_among_equal_loads():
    d = choose([load("a"), load("b")], POLICY, random.Random(0), hits={"a": 0.0, "b": 0.8})
    assert d.url == "b" and d.reason == "prefix"


def test_a_longer_hit_beats_a_shorter_one_and_no_hit_is_a_plain_tie():
    assert choose([load("a"), load("b")], POLICY, random.Random(0), hits={"a": 0.3, "b": 0.6}).url == "b"
    picks = Counter(choose([load("a"), load("b")], POLICY, random.Random(i), hits={"a": 0.0, "b": 0.0}).reason
                    for i in range(20))
    assert picks == {"tie": 20}


def test_equal_holders_share_at_random():
    rng = random.Random(2)
    picks = Counter(choose([load("a"), load("b"), load("c")], POLICY, rng, hits={"a": 0.5, "b": 0.5}).url
                    for _ in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 60


def test_the_prefix_term_outweighs_a_one_request_queue_but_not_saturation():
    holder, idle = load("a", waiting=1, running=4), load("b", running=4)
    assert choose([holder, idle], POLICY, hits={"a": 1.0}).url == "a"
    full = load("a", waiting=5, running=4)  # at the queue threshold: skipped whatever it holds
    assert choose([full, idle], POLICY, hits={"a": 1.0}).url == "b"


def test_within_bound_counts_the_new_request_in_the_mean():
    assert within_bound([load("a"), load("b")], 1.25) == {"a", "b"}  # an idle fleet: everyone
    # total 4 (+1) over 2 workers, x1.25 -> 3.125, ceil 4: "a" (3 + 1) is still within, "b" too.
    assert within_bound([load("a", running=3), load("b", running=1)], 1.25) == {"a", "b"}
    assert within_bound([load("a", running=4), load("b")], 1.25) == {"b"}
    assert within_bound([load("a", running=4), load("b")], 2.0) == {"a", "b"}


def test_a_holder_over_its_bound_loses_its_prefix_term():
    hot, cold = load("a", running=4, max_num_seqs=8), load("b", max_num_seqs=8)
    d = choose([hot, cold], POLICY, random.Random(0), hits={"a": 1.0})
    assert d.url == "b" and d.reason == "bounded"
    assert d.scores["a"] < d.scores["b"]


def test_a_hot_prefix_spreads_once_its_holder_carries_more_than_its_share():
    """Every request shares one prefix, every worker holds it after its first: bounded loads keep the
    split within load_factor of even, where the prefix term alone would send all to the first holder."""
    loads = [load("a", max_num_seqs=16), load("b", max_num_seqs=16)]
    rng, hits = random.Random(0), {"a": 1.0}
    for _ in range(40):
        d = choose(loads, POLICY, rng, hits=hits)
        next(w for w in loads if w.url == d.url).unreflected += 1
        hits[d.url] = 1.0
    counts = sorted(w.unreflected for w in loads)
    assert counts[1] <= 0.65 * 40 and counts[0] >= 14


def test_without_hits_the_choice_is_queue_depth_alone():
    loads = [load("a", waiting=2, running=4), load("b", waiting=1, running=4, kv=0.3)]
    assert choose(loads, POLICY, random.Random(0), hits=None) == choose(loads, POLICY, random.Random(0), hits={})
    assert scores(loads, POLICY) == scores(loads, POLICY, {"a": 0.0})


@pytest.mark.parametrize("kwargs", [dict(prefix_weight=-1), dict(load_factor=0.9)])
def test_bad_prefix_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        RoutingPolicy(**kwargs)


def test_a_prefix_nobody_holds_goes_to_the_worker_caching_least():
    tied = [load("a"), load("b")]
    picks = {choose(tied, POLICY, random.Random(i), hits={"a": 0.0, "b": 0.0}, held={"a": 40, "b": 10}).url
             for i in range(20)}
    assert picks == {"b"}
    # a hit decides before what is held does
    assert choose(tied, POLICY, random.Random(0), hits={"a": 0.5}, held={"a": 40, "b": 10}).url == "a"
