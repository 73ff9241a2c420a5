"""The hold queue for models scaled to zero (gateway/cold_start.py): bound, timeout, release, order, wake."""

import asyncio
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import httpx  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pagefleet.gateway import cold_start  # noqa: E402
from pagefleet.gateway.cold_start import FULL, RELEASED, TIMED_OUT, ColdStartHold, ColdStarts  # noqa: E402
from pagefleet.gateway.membership import Fleet, ServiceView, scale_from_zero  # noqa: E402
from pagefleet.gateway.probe import Prober  # noqa: E402


class Wakes:
    """A wake that records which services it was asked to scale."""

    def __init__(self, fail: bool = False):
        self.calls: list[str] = []
        self.fail = fail

    async def __call__(self, service: str) -> None:
        self.calls.append(service)
        if self.fail:
            raise RuntimeError("apiserver down")


def cold(**kw) -> tuple[ColdStarts, Wakes]:
    wakes = Wakes(kw.pop("fail", False))
    starts = ColdStarts(wake=wakes, **kw)
    starts.update({"smol": "smol-isvc", "sql": "smol-isvc", "qwen": "qwen-isvc"}, set())
    return starts, wakes


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_held_requests_are_released_in_arrival_order_once_a_worker_joins():
    starts, wakes = cold()
    finished = []

    async def one(i):
        outcome = await starts.hold("smol")
        finished.append((i, outcome))

    tasks = [asyncio.create_task(one(i)) for i in range(5)]
    await settle()
    assert len(starts.held["smol"]) == 5 and finished == []
    assert wakes.calls == ["smol-isvc"]  # one wake for the burst, not one per request
    starts.update(ready={"smol"})
    await asyncio.gather(*tasks)
    assert finished == [(i, RELEASED) for i in range(5)]
    assert "smol" not in starts.held and starts.last_seconds["smol"] >= 0
    assert await starts.hold("smol") == RELEASED and "smol" not in starts.held  # warm: nothing to wait for


async def test_past_the_bound_a_request_is_refused_at_once_and_other_groups_keep_their_own_bound():
    starts, _ = cold(max_held=2)
    first = [asyncio.create_task(starts.hold("smol")) for _ in range(2)]
    await settle()
    assert await starts.hold("smol") == FULL
    other = asyncio.create_task(starts.hold("qwen"))  # another model's queue is not full
    await settle()
    assert not other.done() and len(starts.held["qwen"]) == 1
    starts.update(ready={"smol", "qwen"})
    assert await asyncio.gather(*first, other) == [RELEASED] * 3
    assert starts.refused.labels("smol", FULL)._value.get() == 1


async def test_no_worker_within_the_timeout_gives_timed_out_and_frees_the_place():
    starts, _ = cold(timeout_s=0.2, rewake_s=0.05)
    assert await asyncio.wait_for(starts.hold("smol"), 2) == TIMED_OUT
    assert len(starts.held["smol"]) == 0
    assert starts.retry_after("smol") == 1  # the cold start is overdue: try again soon


async def test_wake_is_repeated_while_requests_stay_held_and_a_failing_wake_does_not_break_the_hold():
    starts, wakes = cold(timeout_s=0.5, rewake_s=0.1, fail=True)
    assert await starts.hold("sql") == TIMED_OUT
    assert len(wakes.calls) >= 3 and set(wakes.calls) == {"smol-isvc"}  # the adapter wakes its service


async def test_a_group_that_is_not_wakeable_or_already_warm_is_not_cold():
    starts, _ = cold()
    assert starts.is_cold("smol") and not starts.is_cold("unknown")
    starts.update(ready={"smol", "sql", "qwen"})
    assert not starts.any_cold()


async def test_retry_after_is_what_is_left_of_the_last_cold_start():
    now = [100.0]
    starts = ColdStarts(timeout_s=60, clock=lambda: now[0])
    starts.update({"smol": "s"}, set())
    assert starts.retry_after("smol") == 60  # nothing measured yet: the timeout
    starts.cold_since["smol"] = 100.0
    now[0] = 112.0
    starts.update(ready={"smol"})
    assert starts.last_seconds["smol"] == 12.0
    starts.update(ready=set())
    starts.cold_since["smol"] = now[0] = 200.0
    now[0] = 205.0
    assert starts.retry_after("smol") == 7


def test_flags_refuse_non_positive_values():
    import argparse

    parser = argparse.ArgumentParser()
    cold_start.add_arguments(parser)
    assert parser.parse_args([]).cold_start_timeout_s == 120.0
    for bad in (["--cold-start-timeout-s", "0"], ["--cold-start-queue", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(ValueError):
        ColdStarts(max_held=0)


# ---- the ASGI hold in front of the proxy ------------------------------------------------------------

def echo_app(seen: list):
    async def completions(request):
        body = await request.json()
        seen.append(body["prompt"])
        return JSONResponse({"model": body["model"], "prompt": body["prompt"]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


async def test_a_request_for_a_cold_model_waits_and_reaches_the_proxy_with_its_body_intact():
    starts, wakes = cold()
    seen = []
    app = ColdStartHold(echo_app(seen), starts)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        tasks = [asyncio.create_task(c.post("/v1/completions", json={"model": "smol", "prompt": f"p{i}"}))
                 for i in range(20)]
        while len(starts.held.get("smol", ())) < 20:
            await asyncio.sleep(0.01)
        assert seen == []
        warm = await c.post("/v1/completions", json={"model": "other", "prompt": "x"})  # not a cold group
        assert warm.status_code == 200 and seen == ["x"]
        starts.update(ready={"smol"})
        answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200] * 20
    assert [a.json()["prompt"] for a in answers] == [f"p{i}" for i in range(20)]
    assert seen[1:] == [f"p{i}" for i in range(20)]  # the proxy saw them in arrival order
    assert wakes.calls == ["smol-isvc"]


async def test_past_the_bound_or_the_timeout_the_answer_is_503_with_retry_after():
    starts, _ = cold(max_held=1, timeout_s=0.3, rewake_s=0.1)
    app = ColdStartHold(echo_app([]), starts)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"model": "smol", "prompt": "a"}))
        while not starts.held.get("smol"):
            await asyncio.sleep(0.01)
        full = await c.post("/v1/completions", json={"model": "smol", "prompt": "b"})
        assert full.status_code == 503 and int(full.headers["retry-after"]) >= 1
        assert "more than 1 requests are waiting" in full.json()["error"]["message"]
        late = await asyncio.wait_for(held, 5)
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert "within 0.3s" in late.json()["error"]["message"]


async def test_a_client_that_leaves_while_held_gives_up_its_place():
    starts, _ = cold()
    app = ColdStartHold(echo_app([]), starts)
    body = json.dumps({"model": "smol", "prompt": "p"}).encode()
    sent, gone = [], asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    call = asyncio.create_task(app(scope, receive, send))
    while not starts.held.get("smol"):
        await asyncio.sleep(0.01)
    gone.set()
    await asyncio.wait_for(call, 2)
    assert len(starts.held["smol"]) == 0 and sent == []


async def test_with_every_group_warm_the_body_is_not_read():
    starts, _ = cold()
    starts.update(ready={"smol", "sql", "qwen"})
    reached = []

    async def inner(scope, receive, send):
        reached.append(await receive())

    async def receive():
        return {"type": "http.request", "body": b"not json", "more_body": False}

    await ColdStartHold(inner, starts)({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, None)
    assert reached == [{"type": "http.request", "body": b"not json", "more_body": False}]


# ---- membership: which groups are wakeable, and the release after the worker is in the router ---------

def test_service_view_reads_groups_and_the_scale_to_zero_annotation():
    svc = {"metadata": {"name": "smol", "annotations": {"pagefleet.io/served-model-name": "m",
                                                        "pagefleet.io/lora-adapters": "sql",
                                                        "pagefleet.io/scale-to-zero": "true"}}}
    assert ServiceView.of(svc) == ServiceView(("m", "sql"), True)
    assert ServiceView.of({"metadata": {"name": "plain"}}) == ServiceView(("plain",), False)


async def test_fleet_releases_held_requests_only_once_the_worker_is_in_the_router():
    router = litellm.Router(model_list=[], routing_strategy="simple-shuffle")
    starts = ColdStarts()
    fleet = Fleet(router, Prober(interval_s=10), cold_starts=starts)
    fleet.sync(set(), {"smol": "smol"})
    seen_in_router = []

    async def held():
        outcome = await starts.hold("smol")
        seen_in_router.append(len(router.get_model_list(model_name="smol") or []))
        return outcome

    task = asyncio.create_task(held())
    await settle()
    fleet.sync({("smol", "http://10.0.0.1:8000")}, {"smol": "smol"})
    assert await task == RELEASED and seen_in_router == [1]
    fleet.sync(set())  # the worker left; the group is still wakeable (no new wakeable map given)
    assert starts.is_cold("smol")


class _ScaleApi(BaseHTTPRequestHandler):
    """The scale subresource of one InferenceService, as the API server serves it."""

    state = {"replicas": 0, "version": 1, "conflicts": 0, "puts": []}

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self):
        spec = {"replicas": self.state["replicas"]} if self.state["replicas"] else {}  # omitempty, as autoscaling/v1
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": spec,
                "metadata": {"name": "smol", "namespace": "ns", "resourceVersion": str(self.state["version"])}}

    def do_GET(self):  # noqa: N802
        self._send(200, self._scale())

    def do_PUT(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.state["puts"].append((self.path, body))
        if self.state["conflicts"]:
            self.state["conflicts"] -= 1
            self.state["version"] += 1
            self._send(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
            return
        self.state["replicas"] = body["spec"]["replicas"]
        self._send(200, self._scale())

    def log_message(self, *args):
        pass


@pytest.fixture
def scale_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ScaleApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    yield client.ApiClient(configuration)
    server.shutdown()
    server.server_close()


def test_scale_from_zero_sets_one_replica_only_from_zero_and_retries_a_conflict(scale_api):
    _ScaleApi.state.update(replicas=0, version=1, conflicts=1, puts=[])
    assert scale_from_zero(scale_api, "ns", "smol") is True
    (first, _), (path, body) = _ScaleApi.state["puts"]
    assert path.startswith("/apis/pagefleet.io/v1alpha1/namespaces/ns/inferenceservices/smol/scale")
    assert "fieldManager=pagefleet-gateway" in path
    assert body["spec"] == {"replicas": 1} and body["metadata"]["resourceVersion"] == "2"  # read again after 409
    assert _ScaleApi.state["replicas"] == 1
    assert scale_from_zero(scale_api, "ns", "smol") is False  # already scaled: nothing written
    assert len(_ScaleApi.state["puts"]) == 2
