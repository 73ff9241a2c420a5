"""Prefix-aware routing against queue-depth on the e2e control plane: two real workers, three gateways.

One InferenceService of two workers (the bundled model on CPU, 80 KV blocks of 16 tokens each: together
they hold the multi-turn working set, one alone does not) behind three `pagefleet gateway --kubernetes`:
queue-depth, prefix-aware keyed by text chunks (the default), prefix-aware keyed by the model's tokens.
e2e/bench_prefix_routing.py drives each in turn and prints hit rates (the workers' own counters), the
gateway's estimate, TTFT p50/p99 and the busiest worker's share. Asserted here: what does not depend on
the machine's speed (hit rates against queue-depth's and against perfect affinity, the share bound, the
estimate); the timings are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

import bench_prefix_routing as bench
import control_plane

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

SERVED = "smol-prefix"
MASTER_KEY = "sk-pagefleet-prefix"
KV_BLOCKS = 80
READY_TIMEOUT = 600  # workers load the bundled model on a small shared CPU
GATEWAYS = ("queue-depth", "prefix-text", "prefix-tokens")


def _start(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with open(log_path, "a") as log:
        # cwd outside the checkout: its top-level operator/ would shadow the standard library's operator.
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _gateway_workers(url: str) -> set[str]:
    """The workers a gateway probes and finds up, from its own metrics."""
    try:
        text = httpx.get(url + "/pagefleet/metrics", timeout=2).text
    except httpx.HTTPError:
        return set()
    return {m.group(1) for m in re.finditer(r'^pagefleet_gateway_worker_up\{worker="([^"]+)"\} 1\.0$', text, re.M)}


def _ready_workers(cluster, ns: str) -> set[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagefleet.io/inference-service=smol")["items"]
    return {f"http://{p['status']['podIP']}:8000" for p in pods
            if p["metadata"].get("deletionTimestamp") is None and p.get("status", {}).get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])}


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix-routing")
    env = {**os.environ, **cluster.env, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    model = subprocess.run([sys.executable, "-c", "from pagefleet.worker.models.loader import bundled_model_path; "
                            "print(bundled_model_path())"], capture_output=True, text=True, timeout=900,
                           cwd=tmp, env=env)
    assert model.returncode == 0, model.stderr
    model_path = model.stdout.strip().splitlines()[-1]
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.pagefleet.io")
    ns = f"pf-prefix-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    procs = [_start([sys.executable, "-m", "pagefleet", "operator", "--namespace", ns], env, tmp / "operator.log")]
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "smol"},
            "spec": {"replicas": 2, "model": {"name": SERVED, "hostPath": {"path": model_path}},
                     "resources": {"gpus": 0}, "drainSeconds": 2,
                     "engine": {"maxModelLen": 1024, "maxNumSeqs": 4,
                                "extraArgs": ["--num-gpu-blocks-override", str(KV_BLOCKS), "--cpu-threads", "1"]}}}
    cluster.apply(yaml.safe_dump(body), namespace=ns)
    gateways = {}
    for name in GATEWAYS:
        port = control_plane.free_port()
        routing = ["--routing", "queue-depth"] if name == "queue-depth" else ["--routing", "prefix-aware"]
        if name == "prefix-tokens":
            routing += ["--prefix-tokenizer", model_path]
        procs.append(_start([sys.executable, "-m", "pagefleet", "gateway", "--kubernetes", "--namespace", ns,
                             "--host", "127.0.0.1", "--port", str(port), "--master-key", MASTER_KEY, *routing],
                            env, tmp / f"gateway-{name}.log"))
        gateways[name] = f"http://127.0.0.1:{port}"
    try:
        def two_ready():
            ready = _ready_workers(cluster, ns)
            return ready if len(ready) == 2 else None

        workers = cluster.wait_for("two ready workers", two_ready, timeout=READY_TIMEOUT)
        for name, url in gateways.items():
            cluster.wait_for(f"gateway {name} to probe {workers}", lambda u=url: _gateway_workers(u) == workers,
                             timeout=120)
        yield {"workers": sorted(workers), "gateways": gateways}
    finally:
        for proc in procs[1:]:
            _stop(proc)
        cluster.kubectl("delete", "infsvc", "--all", "-n", ns, "--wait=false", check=False)
        _stop(procs[0])
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_prefix_aware_routing_raises_the_hit_rate_within_the_share_bound(fleet):
    phases = asyncio.run(bench.run_all(list(fleet["gateways"].items()), MASTER_KEY, SERVED, fleet["workers"]))
    print("\n" + bench.report(phases))
    by_name = {p.name: p for p in phases}
    base = by_name["queue-depth"]
    for name in ("prefix-text", "prefix-tokens"):
        ours = by_name[name]
        # Queue-depth already finds about 4/5 of the ideal on two workers (a turn lands where the one before
        # did half the time, and the other worker holds the turn before that): the gain has that ceiling.
        assert bench.hit_rate(ours, "multi-turn") >= 1.1 * bench.hit_rate(base, "multi-turn"), name
        assert bench.hit_rate(ours, "multi-turn") >= 0.85 * bench.ideal_hit_rate(ours), name
        assert bench.hit_rate(ours, "shared-system") >= bench.hit_rate(base, "shared-system") - 0.05, name
        assert bench.busiest_share(ours) <= 0.65, name
        expected, queried = ours.estimate["multi-turn"]
        assert abs(expected / queried - bench.hit_rate(ours, "multi-turn")) < 0.1, name  # the index is close
