"""Scale to zero end to end, on the real control plane of e2e/ (pods are local processes).

An InferenceService with `autoscaling.minReplicas: 0` and a short `scaleToZeroAfterSeconds` runs the bundled
model behind `pagefleet gateway --kubernetes`. Idle, the operator takes it to 0 replicas (phase Idle, the
Idle condition, a ScaledToZero Event); a request through the gateway is then held while the gateway scales
it to 1 and answered once the worker is ready; 20 requests arriving during one cold start are all answered;
through a second gateway with a 4 s cold-start timeout and a queue of 3, a cold start that cannot finish gets
503s with Retry-After, and nothing waits past the timeout. The cold-start times are printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

import control_plane
from processes import start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

MASTER_KEY = "sk-pagefleet-s2z"
SERVED = f"smol-s2z-{uuid.uuid4().hex[:4]}"
IDLE_AFTER = 8  # scaleToZeroAfterSeconds: the first request must reach the new worker within it
READY_TIMEOUT = 600  # the bundled model loads on a small shared CPU
SHORT_TIMEOUT, SHORT_QUEUE = 4, 3  # the second gateway's --cold-start-timeout-s and --cold-start-queue


def _gateway(ns: str, env: dict, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = control_plane.free_port()
    proc = start_process([sys.executable, "-m", "pagefleet", "gateway", "--kubernetes", "--namespace", ns,
                          "--host", "127.0.0.1", "--port", str(port), "--master-key", MASTER_KEY,
                          "--probe-interval-ms", "200", *extra], env, log_path)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale-to-zero")
    env = {**os.environ, **cluster.env, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "PAGEFLEET_STATUS_INTERVAL": "1", "PAGEFLEET_AUTOSCALE_INTERVAL": "1"}
    model = subprocess.run([sys.executable, "-c", "from pagefleet.worker.models.loader import bundled_model_path; "
                            "print(bundled_model_path())"], capture_output=True, text=True, timeout=900,
                           cwd=tmp, env=env)
    assert model.returncode == 0, model.stderr
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.pagefleet.io")
    ns = f"pf-s2z-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    operator = start_process([sys.executable, "-m", "pagefleet", "operator", "--namespace", ns, "--verbose"], env,
                             tmp / "operator.log")
    gateway, url = _gateway(ns, env, tmp / "gateway.log", "--cold-start-timeout-s", "300")
    short, short_url = _gateway(ns, env, tmp / "gateway-short.log", "--cold-start-timeout-s", str(SHORT_TIMEOUT),
                                "--cold-start-queue", str(SHORT_QUEUE))
    for gateway_url in (url, short_url):  # both watch the namespace before the service exists
        cluster.wait_for(f"gateway {gateway_url} ready", lambda u=gateway_url: _ready(u), timeout=300, interval=1)
    handle = {"ns": ns, "model_path": model.stdout.strip().splitlines()[-1], "url": url, "short_url": short_url,
              "procs": (operator, gateway, short)}
    try:
        yield handle
    finally:
        stop_process(gateway)
        stop_process(short)
        cluster.kubectl("delete", "infsvc", "--all", "-n", ns, "--wait=false", check=False)
        stop_process(operator)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for name in ("operator.log", "gateway.log", "gateway-short.log"):
            print(f"---- {name} (tail) ----\n" + "\n".join((tmp / name).read_text(errors="replace")
                                                            .splitlines()[-40:]))


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health/readiness", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def spec(model_path: str, **autoscaling) -> dict:
    return {"model": {"name": SERVED, "hostPath": {"path": model_path}}, "replicas": 1,
            "resources": {"gpus": 0}, "engine": {"maxModelLen": 512, "maxNumSeqs": 4}, "drainSeconds": 2,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": IDLE_AFTER, **autoscaling}}


def infsvc(cluster, ns: str) -> dict:
    return cluster.kubectl_json("get", "infsvc", "smol", "-n", ns)


def live_pods(cluster, ns: str) -> list[dict]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagefleet.io/inference-service=smol")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def events(cluster, ns: str) -> list[dict]:
    found = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=smol")["items"]
    return sorted(found, key=lambda e: e.get("lastTimestamp") or "")


def gateway_workers(url: str) -> set[str]:
    try:
        text = httpx.get(url + "/pagefleet/metrics", timeout=2).text
    except httpx.HTTPError:
        return set()
    return set(re.findall(r'^pagefleet_gateway_worker_up\{worker="([^"]+)"\} 1\.0$', text, re.M))


def gateway_cold_start_seconds(url: str) -> float | None:
    text = httpx.get(url + "/pagefleet/metrics", timeout=5).text
    found = re.search(rf'^pagefleet_gateway_cold_start_seconds\{{model="{SERVED}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def complete(url: str, prompt: str, timeout: float = 600, model: str = SERVED) -> tuple[int, float, httpx.Response]:
    """One completion through a gateway: (status, seconds, response)."""
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", timeout=timeout, headers={"Authorization": f"Bearer {MASTER_KEY}"},
                          json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    return response.status_code, time.monotonic() - started, response


def phase_is(cluster, ns: str, phase: str) -> dict | None:
    obj = infsvc(cluster, ns)
    return obj if (obj.get("status") or {}).get("phase") == phase else None


def wait_idle(cluster, ns: str) -> dict:
    """Until the operator has taken the service to zero and its worker is gone."""
    def idle():
        obj = infsvc(cluster, ns)
        st = obj.get("status") or {}
        cond = next((c for c in st.get("conditions") or [] if c["type"] == "Idle"), {})
        at_zero = (st.get("autoscaling") or {}).get("lastDecision", "").startswith("AtZero")  # the pass after
        return obj if (obj["spec"]["replicas"] == 0 and st.get("phase") == "Idle" and cond.get("status") == "True"
                       and at_zero and not live_pods(cluster, ns)) else None

    return cluster.wait_for("the service scaled to zero (phase Idle, no live pod)", idle, timeout=90, interval=0.5)


# ---- the API server refuses bad scale-to-zero settings, with messages that say why ------------------

BAD = [
    ("scaleToZeroAfterSeconds with minReplicas 1", {"minReplicas": 1, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60},
     "spec.autoscaling.scaleToZeroAfterSeconds needs minReplicas: 0"),
    ("minReplicas 0 without a delay", {"minReplicas": 0, "maxReplicas": 2},
     "spec.autoscaling.minReplicas: 0 needs scaleToZeroAfterSeconds"),
    ("negative delay", {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": -5},
     "spec.autoscaling.scaleToZeroAfterSeconds: Invalid value: -5"),
    ("negative minReplicas", {"minReplicas": -1, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60},
     "spec.autoscaling.minReplicas: Invalid value: -1"),
]


@pytest.mark.parametrize("what, autoscaling, message", BAD, ids=[b[0] for b in BAD])
def test_api_server_refuses_bad_scale_to_zero_settings(cluster, setup, what, autoscaling, message):
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "bad"},
            "spec": {"model": {"name": "m", "hostPath": {"path": "/m"}}, "autoscaling": autoscaling}}
    result = cluster.kubectl("apply", "-n", setup["ns"], "--dry-run=server", "-f", "-", input=yaml.safe_dump(body),
                             check=False)
    assert result.returncode != 0, f"{what}: accepted"
    assert "is invalid" in result.stderr and message in result.stderr, result.stderr


# ---- idle -> 0 replicas -> a request wakes it ------------------------------------------------------

def test_idle_service_goes_to_zero_and_a_request_wakes_it(cluster, setup):
    ns, url = setup["ns"], setup["url"]
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "smol"},
            "spec": spec(setup["model_path"])}
    cluster.apply(yaml.safe_dump(body), namespace=ns)
    cluster.wait_for("the gateway to list the first worker", lambda: gateway_workers(url), timeout=READY_TIMEOUT)
    status, _, response = complete(url, "Hello")
    assert status == 200, response.text
    first = cluster.wait_for("status.lastStartSeconds", lambda: infsvc(cluster, ns)["status"].get("lastStartSeconds"),
                             timeout=30)

    wait_idle(cluster, ns)
    down = [e for e in events(cluster, ns) if e["reason"] == "ScaledToZero"]
    assert down and "replicas 1 -> 0" in down[-1]["message"], [e["reason"] for e in events(cluster, ns)]
    cluster.wait_for("the gateway to drop the worker", lambda: not gateway_workers(url), timeout=30)

    status, seconds, response = complete(url, "The capital of France is")
    assert status == 200, response.text
    assert response.json()["choices"][0]["text"]
    woke = infsvc(cluster, ns)
    up = [e for e in events(cluster, ns) if e["reason"] == "ScaledFromZero"]
    assert up and "spec.replicas 0 -> 1 while idle" in up[-1]["message"], up
    assert woke["spec"]["replicas"] == 1
    ready = cluster.wait_for("phase Ready again", lambda: phase_is(cluster, ns, "Ready"), timeout=30)
    print(f"\n[scale to zero] cold start: request answered {seconds:.1f}s after it was sent; gateway held it "
          f"{gateway_cold_start_seconds(url):.1f}s; status.lastStartSeconds {ready['status']['lastStartSeconds']}s "
          f"(first start {first}s)")


def test_twenty_requests_during_one_cold_start_are_all_answered(cluster, setup):
    ns, url = setup["ns"], setup["url"]
    wait_idle(cluster, ns)
    cluster.wait_for("the gateway to drop the worker", lambda: not gateway_workers(url), timeout=30)
    before = len([e for e in events(cluster, ns) if e["reason"] == "ScaledFromZero"])
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: complete(url, f"Count from {i}:"), range(20)))
    assert [s for s, _, _ in results] == [200] * 20, [r.text[:200] for _, _, r in results if r.status_code != 200]
    assert len([e for e in events(cluster, ns) if e["reason"] == "ScaledFromZero"]) == before + 1
    latencies = sorted(t for _, t, _ in results)
    print(f"\n[scale to zero] 20 requests during one cold start: all 200, latency min {latencies[0]:.1f}s "
          f"max {latencies[-1]:.1f}s; gateway cold start {gateway_cold_start_seconds(url):.1f}s")


def test_a_cold_start_past_the_timeout_gets_503_and_nothing_hangs(cluster, setup, tmp_path):
    """A service whose worker can never start (its checkpoint directory is missing on the node: FailedMount):
    through the gateway with a 4 s timeout and a queue of 3, the held requests get 503 at the timeout and
    the ones past the bound get 503 at once, each with Retry-After."""
    ns, short = setup["ns"], setup["short_url"]
    never = f"never-{uuid.uuid4().hex[:4]}"
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "never"},
            "spec": {**spec(str(tmp_path / "no-such-checkpoint")), "replicas": 0,
                     "model": {"name": never, "hostPath": {"path": str(tmp_path / "no-such-checkpoint")}}}}
    cluster.apply(yaml.safe_dump(body), namespace=ns)
    cluster.wait_for("the never service Idle", lambda: cluster.kubectl_json("get", "infsvc", "never", "-n", ns)
                     .get("status", {}).get("phase") == "Idle", timeout=60)
    time.sleep(2)  # the Service, annotated scale-to-zero, reaches the gateway's watch
    started = time.monotonic()
    with ThreadPoolExecutor(SHORT_QUEUE + 3) as pool:
        results = list(pool.map(lambda i: complete(short, f"Hi {i}", timeout=60, model=never), range(SHORT_QUEUE + 3)))
    elapsed = time.monotonic() - started
    statuses = [s for s, _, _ in results]
    assert statuses == [503] * len(results), [r.text[:200] for _, _, r in results]
    assert elapsed < SHORT_TIMEOUT + 10, f"requests waited {elapsed:.1f}s with a {SHORT_TIMEOUT}s timeout"
    for _, _, response in results:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "service_unavailable"
    held = [t for _, t, r in results if "within" in r.json()["error"]["message"]]
    full = [t for _, t, r in results if "are waiting" in r.json()["error"]["message"]]
    assert len(held) == SHORT_QUEUE and len(full) == 3
    assert min(held) >= SHORT_TIMEOUT - 0.5 and max(full) < SHORT_TIMEOUT
    # The gateway did ask for a worker; the API server's side of it is the pod that cannot mount its model.
    assert cluster.kubectl_json("get", "infsvc", "never", "-n", ns)["spec"]["replicas"] == 1
    print(f"\n[scale to zero] past a {SHORT_TIMEOUT}s timeout: {len(held)} held requests got 503 after "
          f"{min(held):.1f}-{max(held):.1f}s, {len(full)} over the queue bound at once "
          f"({max(full):.2f}s); Retry-After {sorted({r.headers['retry-after'] for _, _, r in results})}")
    cluster.kubectl("delete", "infsvc", "never", "-n", ns, "--wait=false")
