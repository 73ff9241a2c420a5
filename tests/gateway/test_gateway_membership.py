"""Membership and the strategy on a real LiteLLM Router: EndpointSlices -> deployments -> the choice."""

import asyncio
import os
import random

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import pytest  # noqa: E402

from pagefleet.gateway.membership import Fleet, model_groups, ready_workers  # noqa: E402
from pagefleet.gateway.probe import Prober  # noqa: E402
from pagefleet.gateway.routing import RoutingPolicy  # noqa: E402
from pagefleet.gateway.strategy import QueueDepthStrategy, worker_url_of  # noqa: E402


def endpoint_slice(endpoints, port=8000, port_name="http", family="IPv4"):
    return {
        "metadata": {"name": "smol-abcde", "labels": {"kubernetes.io/service-name": "smol"}},
        "addressType": family,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_only_ready_not_terminating_endpoints_are_workers():
    s = endpoint_slice([
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
        {"addresses": ["10.0.0.4"]},  # conditions unset: ready by the API's convention
    ])
    assert ready_workers(s, "smol-model") == {("smol-model", "http://10.0.0.1:8000"),
                                              ("smol-model", "http://10.0.0.4:8000")}


def test_slice_without_our_port_or_endpoints_gives_nothing():
    assert ready_workers(endpoint_slice([{"addresses": ["10.0.0.1"]}], port_name="metrics"), "m") == set()
    assert ready_workers({"metadata": {}, "endpoints": None, "ports": None}, "m") == set()


def test_ipv6_addresses_are_bracketed():
    s = endpoint_slice([{"addresses": ["fd00::5"], "conditions": {"ready": True}}], family="IPv6")
    assert ready_workers(s, "m") == {("m", "http://[fd00::5]:8000")}


def test_lora_adapters_are_model_groups_of_the_same_workers():
    annotations = {"pagefleet.io/served-model-name": "llama", "pagefleet.io/lora-adapters": "sql, chat-de,"}
    assert model_groups(annotations, "svc") == ["llama", "sql", "chat-de"]
    assert model_groups({}, "svc") == ["svc"]


def test_an_adapter_group_routes_to_its_workers_and_leaves_with_them():
    router = litellm.Router(model_list=[], routing_strategy="simple-shuffle")
    prober = Prober(interval_s=10)
    fleet = Fleet(router, prober)
    s = endpoint_slice([{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}])
    fleet.sync(set().union(*(ready_workers(s, m) for m in model_groups({"pagefleet.io/lora-adapters": "sql"}, "smol"))))
    for group in ("smol", "sql"):
        assert sorted(worker_url_of(d) for d in router.get_model_list(model_name=group)) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # the worker is asked for the adapter by name: LiteLLM sends model=sql to it
    assert {d["litellm_params"]["model"] for d in router.get_model_list(model_name="sql")} == {"openai/sql"}
    assert set(prober.loads) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}  # probed once per worker
    fleet.sync(set())
    assert router.model_list == [] and prober.loads == {}


@pytest.fixture
def router_and_fleet():
    router = litellm.Router(model_list=[], routing_strategy="simple-shuffle")
    prober = Prober(interval_s=10)
    return router, Fleet(router, prober), prober


def test_fleet_adds_and_removes_litellm_deployments_live(router_and_fleet):
    router, fleet, prober = router_and_fleet
    fleet.sync({("smol", "http://10.0.0.1:8000"), ("smol", "http://10.0.0.2:8000"), ("qwen", "http://10.0.0.3:8000")})
    assert sorted(worker_url_of(d) for d in router.get_model_list(model_name="smol")) == [
        "http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert [worker_url_of(d) for d in router.get_model_list(model_name="qwen")] == ["http://10.0.0.3:8000"]
    assert set(prober.loads) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    fleet.sync({("smol", "http://10.0.0.2:8000"), ("qwen", "http://10.0.0.3:8000")})
    assert [worker_url_of(d) for d in router.get_model_list(model_name="smol")] == ["http://10.0.0.2:8000"]
    assert "http://10.0.0.1:8000" not in prober.loads
    fleet.sync(set())
    assert router.model_list == [] and prober.loads == {}


def test_strategy_on_the_router_routes_by_probed_queue(router_and_fleet):
    router, fleet, prober = router_and_fleet
    fleet.sync({("smol", "http://10.0.0.1:8000"), ("smol", "http://10.0.0.2:8000")})
    router.set_custom_routing_strategy(QueueDepthStrategy(router, prober, RoutingPolicy(), random.Random(0)))
    busy, idle = prober.loads["http://10.0.0.1:8000"], prober.loads["http://10.0.0.2:8000"]
    for w in (busy, idle):
        w.up, w.max_num_seqs = True, 2
    busy.waiting, busy.running = 6, 2

    async def pick():
        d = await router.async_get_available_deployment(model="smol", request_kwargs={},
                                                        messages=[{"role": "user", "content": "hi"}])
        return worker_url_of(d)

    async def burst():
        return [await pick() for _ in range(6)]

    assert asyncio.run(burst()) == ["http://10.0.0.2:8000"] * 6
    assert idle.unreflected == 6  # each choice counted until a probe reflects it
    decisions = prober.metrics.decisions.labels("http://10.0.0.2:8000", "best")._value.get()
    assert decisions >= 1


def test_strategy_on_the_router_sends_an_adapter_to_the_workers_holding_it(router_and_fleet):
    """The adapter group "sql" is served by both workers' Service, but only 10.0.0.1 has loaded it: its
    requests go there even though 10.0.0.2 is idle; the base model's requests still go to the idle one."""
    router, fleet, prober = router_and_fleet
    urls = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    fleet.sync({(group, url) for group in ("smol", "sql") for url in urls})
    router.set_custom_routing_strategy(QueueDepthStrategy(router, prober, RoutingPolicy(), random.Random(0)))
    holder, idle = prober.loads[urls[0]], prober.loads[urls[1]]
    for w in (holder, idle):
        w.up, w.max_num_seqs = True, 4
    holder.waiting, holder.running, holder.lora_adapters = 2, 4, frozenset({"sql"})

    async def picks(model):
        return {worker_url_of(await router.async_get_available_deployment(model=model, request_kwargs={}))
                for _ in range(5)}

    assert asyncio.run(picks("sql")) == {urls[0]}
    assert asyncio.run(picks("smol")) == {urls[1]}


def test_strategy_respects_litellm_cooldown(router_and_fleet):
    router, fleet, prober = router_and_fleet
    fleet.sync({("smol", "http://10.0.0.1:8000"), ("smol", "http://10.0.0.2:8000")})
    router.set_custom_routing_strategy(QueueDepthStrategy(router, prober, RoutingPolicy(), random.Random(0)))
    for w in prober.loads.values():
        w.up = True
    prober.loads["http://10.0.0.2:8000"].kv_cache_usage = 0.5  # worse than .1 on its own

    async def run():
        # A 429 from 10.0.0.1 puts it in LiteLLM's cooldown: even as the better score, it is skipped.
        from litellm.router_utils.cooldown_handlers import _set_cooldown_deployments
        _set_cooldown_deployments(router, original_exception=litellm.RateLimitError("busy", "openai", "smol"),
                                  exception_status=429, deployment="smol@http://10.0.0.1:8000", time_to_cooldown=30)
        picks = set()
        for _ in range(10):
            d = await router.async_get_available_deployment(model="smol", request_kwargs={})
            picks.add(worker_url_of(d))
        return picks

    assert asyncio.run(run()) == {"http://10.0.0.2:8000"}
