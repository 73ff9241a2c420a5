"""Prefix-aware routing against queue-depth on the e2e control plane: two real workers, two or three gateways.

One InferenceService of two workers (the bundled model on CPU, `maxNumSeqs` 4) behind `pagefleet gateway
--kubernetes` twice: queue-depth and prefix-aware keyed by text chunks (the default); with
PAGEFLEET_PREFIX_GATEWAYS=queue-depth,prefix-text,prefix-tokens a third, prefix-aware keyed by the model's
tokens (docs/gateway.md's table; ~70 s more, so not in CI, where tests/gateway/test_gateway_prefix.py checks
that the token keys cut prompts where the worker does). e2e/bench_prefix_routing.py drives each in turn and
prints hit rates (the workers' own counters), the gateway's estimate and choices, TTFT p50/p99 and the busiest
worker's share.

The KV size puts both workloads where a fleet serves more prefixes than one worker caches but fewer than
all workers do, the regime prefix affinity is for: scattered requests put every prefix on every worker and
LRU evicts what the next request needs; with affinity each prefix lives on one worker and the fleet caches
twice as much. Each worker has KV_BLOCKS = 128 blocks of 16 tokens (2,048 tokens); the fleet 256.
- Shared system prompts: 8 tenants x 24 blocks (~385 tokens) = 192 blocks, 1.5x one worker and 0.75x the
  fleet. Scattered, each worker meets all 8 (192 > 128); with affinity 4 each, 96 blocks, plus the question
  and answer blocks (~2 a request) of the requests since a prompt's last use.
- Multi-turn: 12 conversations x 18 blocks at their last turn (~293 tokens) = 216 blocks, 1.7x one worker
  and 0.84x the fleet; with affinity 6 each, 108 blocks.
- Running: at most 4 sequences of <= 27 blocks, 108 blocks, so no preemption.
Asserted: what does not depend on the machine's speed (multi-turn hit rates, the share bound, the
estimate); the timings and the shared-system-prompt hit rates are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

import bench_prefix_routing as bench
import control_plane
from processes import start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

SERVED = "smol-prefix"
MASTER_KEY = "sk-pagefleet-prefix"
KV_BLOCKS = 128  # the arithmetic above
READY_TIMEOUT = 600  # workers load the bundled model on a small shared CPU
GATEWAYS = tuple(os.environ.get("PAGEFLEET_PREFIX_GATEWAYS", "queue-depth,prefix-text").split(","))
if not set(GATEWAYS) <= {"queue-depth", "prefix-text", "prefix-tokens"} or "queue-depth" not in GATEWAYS:
    raise ValueError(f"PAGEFLEET_PREFIX_GATEWAYS={','.join(GATEWAYS)}: name queue-depth and any of prefix-text, "
                     "prefix-tokens")


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
    procs = [start_process([sys.executable, "-m", "pagefleet", "operator", "--namespace", ns], env,
                           tmp / "operator.log")]
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
        procs.append(start_process([sys.executable, "-m", "pagefleet", "gateway", "--kubernetes", "--namespace", ns,
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
            stop_process(proc)
        cluster.kubectl("delete", "infsvc", "--all", "-n", ns, "--wait=false", check=False)
        stop_process(procs[0])
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_prefix_aware_routing_raises_the_hit_rate_within_the_share_bound(fleet):
    phases = asyncio.run(bench.run_all(list(fleet["gateways"].items()), MASTER_KEY, SERVED, fleet["workers"]))
    print("\n" + bench.report(phases))
    by_name = {p.name: p for p in phases}
    base = by_name["queue-depth"]
    for name in (g for g in GATEWAYS if g != "queue-depth"):
        ours = by_name[name]
        # Multi-turn: affinity reaches the ceiling of every turn finding the turn before (about 0.71); queue-depth
        # finds 0.47-0.58 of it by chance (the other worker holds the turn before last), so the gain is bounded.
        assert bench.hit_rate(ours, "multi-turn") > bench.hit_rate(base, "multi-turn"), name
        assert bench.hit_rate(ours, "multi-turn") >= 0.85 * bench.ideal_hit_rate(ours), name
        # Shared system prompts: scattered, every worker meets all 8 and evicts; with affinity each holds 4, less
        # the prompts bounded loads copy onto the other worker (4-5 of 48 requests) and the requests that reach
        # a worker while their prompt's first use is still in prefill. How many do depends on the machine's
        # speed (0.47 against queue-depth's 0.53 once, with other work on the same two cores; 1.08-1.47x its
        # hit rate on a quiet machine), so that comparison is printed above, not asserted.
        assert bench.busiest_share(ours) <= 0.65, name
        expected, queried = ours.estimate["multi-turn"]
        assert abs(expected / queried - bench.hit_rate(ours, "multi-turn")) < 0.1, name  # the index is close
