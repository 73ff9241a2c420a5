"""Scale to zero on the operator's side: the idle decision with a fake clock, the activity probe, the status
and the Service annotation the gateway reads (no cluster, no pods)."""

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagefleet.operator import resources, scale_to_zero, status
from pagefleet.operator.scale_to_zero import ACTIVE, NO_SAMPLE, NO_TRAFFIC, SCALED_TO_ZERO, Sample


def step(active, now, idle_since=None, current=1, after=60):
    return scale_to_zero.decide(current=current, active=active, after=after, now=now, idle_since=idle_since)


def test_idle_for_the_delay_scales_to_zero():
    d = step(False, now=100)
    assert (d.replicas, d.idle_since, d.reason) == (1, 100, NO_TRAFFIC)
    d = step(False, now=130, idle_since=d.idle_since)
    assert d.replicas == 1 and d.idle_since == 100 and "30s more" in d.message
    d = step(False, now=160, idle_since=d.idle_since, current=3)
    assert (d.replicas, d.idle_since, d.reason) == (0, None, SCALED_TO_ZERO)
    assert "no request for 60s" in d.message and "replicas 3 -> 0" in d.message


def test_a_request_resets_the_idle_clock():
    d = step(False, now=0)
    d = step(True, now=50, idle_since=d.idle_since)
    assert (d.replicas, d.idle_since, d.reason) == (1, None, ACTIVE)
    d = step(False, now=70, idle_since=d.idle_since)
    assert d.idle_since == 70 and d.replicas == 1  # counts from the first idle pass after the request


def test_no_sample_leaves_the_clock_as_it_is():
    assert step(None, now=500, idle_since=10).idle_since == 10  # a probe failed: nothing is known
    d = step(None, now=500)
    assert (d.replicas, d.idle_since, d.reason) == (1, None, NO_SAMPLE)  # a worker still loading


def test_activity_is_a_request_now_or_a_step_since_the_last_pass():
    seen = {"a": 10, "b": 4}
    assert scale_to_zero.activity({"a": Sample(0, 0, 10), "b": Sample(0, 0, 4)}, seen) is False
    assert scale_to_zero.activity({"a": Sample(0, 0, 11), "b": Sample(0, 0, 4)}, seen) is True  # came and went
    assert scale_to_zero.activity({"a": Sample(1, 0, 10)}, seen) is True
    assert scale_to_zero.activity({"a": Sample(0, 2, 10)}, seen) is True
    assert scale_to_zero.activity({"new": Sample(0, 0, 99)}, seen) is False  # first sight: nothing to compare
    assert scale_to_zero.activity({}, seen) is None


def test_enabled_only_with_min_replicas_zero():
    assert scale_to_zero.enabled({"autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 5}})
    assert not scale_to_zero.enabled({"autoscaling": {"minReplicas": 1, "maxReplicas": 2}})
    assert not scale_to_zero.enabled({"autoscaling": {"maxReplicas": 2}})
    assert not scale_to_zero.enabled({"replicas": 0})


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="smol"} 1.0
vllm:num_requests_waiting{model_name="smol"} 2.0
# HELP pagefleet:engine_steps_total Engine steps run.
pagefleet:engine_steps_total{model_name="smol"} 1234.0
"""


def test_parse_metrics_reads_queue_and_steps():
    assert scale_to_zero.parse_metrics(METRICS) == Sample(2, 1, 1234)
    with pytest.raises(ValueError):
        scale_to_zero.parse_metrics("vllm:num_requests_running 0\n")


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        data = METRICS.encode() if self.path == "/metrics" else b""
        self.send_response(200 if data else 404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_probe_reads_each_worker_and_skips_those_that_do_not_answer():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        samples = asyncio.run(scale_to_zero.probe([url, "http://127.0.0.1:9"], timeout=2.0))
    finally:
        server.shutdown()
        server.server_close()
    assert samples == {url: Sample(2, 1, 1234)}


# ---- status and children -----------------------------------------------------------------------------

NOW = "2026-11-29T10:00:00Z"
TO_ZERO = {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 300}


def body(replicas, autoscaling=TO_ZERO):
    return {"metadata": {"name": "chat", "namespace": "serving", "uid": "u1", "generation": 3},
            "spec": {"model": {"name": "m", "hostPath": {"path": "/models/m"}}, "replicas": replicas,
                     "autoscaling": autoscaling},
            "status": {}}


def ready_pod(created, ready_at, ip="127.0.0.2"):
    return {"metadata": {"name": f"p-{ip}", "creationTimestamp": created},
            "status": {"podIP": ip, "containerStatuses": [{"name": "worker", "started": True, "ready": True}],
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready_at}]}}


def test_at_zero_replicas_the_phase_is_idle_with_an_idle_condition():
    src = status.SourceCheck(None, "WaitingForPods", "wait")
    st = status.compute(body(0), {"metadata": {"generation": 1}, "status": {}}, [], src, desired=0, port=8000, now=NOW)
    conds = {c["type"]: c for c in st["conditions"]}
    assert st["phase"] == "Idle"
    assert conds["Idle"]["status"] == "True" and conds["Idle"]["reason"] == SCALED_TO_ZERO
    assert conds["Ready"]["reason"] == "ScaledToZero" and "gateway" in conds["Ready"]["message"]
    # Without scale to zero, 0 replicas stay "Stopped" and there is no Idle condition.
    plain = status.compute(body(0, {"minReplicas": 1, "maxReplicas": 2}), None, [], src, 0, 8000, NOW)
    assert plain["phase"] == "Stopped" and "Idle" not in {c["type"] for c in plain["conditions"]}


def test_serving_has_idle_false_and_last_start_seconds_from_the_newest_ready_pod():
    pods = [ready_pod("2026-11-29T09:00:00Z", "2026-11-29T09:00:40Z", "127.0.0.2"),
            ready_pod("2026-11-29T09:50:00Z", "2026-11-29T09:50:17Z", "127.0.0.3")]
    src = status.SourceCheck(True, "HostPathMounted", "ok")
    st = status.compute(body(2), None, pods, src, desired=2, port=8000, now=NOW)
    idle = next(c for c in st["conditions"] if c["type"] == "Idle")
    assert idle["status"] == "False" and "300s without a request" in idle["message"]
    assert st["lastStartSeconds"] == 17
    assert "lastStartSeconds" not in status.compute(body(1), None, [], src, 1, 8000, NOW)  # kept from before


def test_the_service_tells_the_gateway_to_hold_requests_while_at_zero():
    annotations = resources.service(body(0))["metadata"]["annotations"]
    assert annotations[resources.SCALE_TO_ZERO_ANNOTATION] == "true"
    plain = resources.service(body(1, {"minReplicas": 1, "maxReplicas": 2}))["metadata"]["annotations"]
    assert resources.SCALE_TO_ZERO_ANNOTATION not in plain
    assert resources.desired_replicas(body(0)["spec"]) == 0  # minReplicas 0 lets the Deployment go to 0
