"""Gateway membership from Kubernetes, on the real control plane of e2e/ (pods are local processes).

The operator turns an InferenceService into a Deployment and a Service labelled
pagefleet.io/inference-service=<name>; the EndpointSlice controller publishes the ready pods.
`pagefleet gateway --kubernetes` watches those slices: scaling the InferenceService from 1 to 2
replicas must add the new pod to the running gateway, and deleting a pod must remove it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import yaml

import control_plane
from processes import start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

SERVED = "smol-gw"
MASTER_KEY = "sk-pagefleet-k8s"
READY_TIMEOUT = 600  # workers load the bundled model on a small shared CPU


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    import os

    tmp = tmp_path_factory.mktemp("gateway-k8s")
    env = {**os.environ, **cluster.env, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    model = subprocess.run([sys.executable, "-c", "from pagefleet.worker.models.loader import bundled_model_path; "
                            "print(bundled_model_path())"], capture_output=True, text=True, timeout=900,
                           cwd=tmp, env=env)
    assert model.returncode == 0, model.stderr
    model_path = model.stdout.strip().splitlines()[-1]
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.pagefleet.io")
    ns = f"pf-gw-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    operator = start_process([sys.executable, "-m", "pagefleet", "operator", "--namespace", ns], env,
                             tmp / "operator.log")
    port = control_plane.free_port()
    gateway = start_process([sys.executable, "-m", "pagefleet", "gateway", "--kubernetes", "--namespace", ns,
                             "--host", "127.0.0.1", "--port", str(port), "--master-key", MASTER_KEY,
                             "--probe-interval-ms", "200"], env, tmp / "gateway.log")
    handle = {"ns": ns, "model_path": model_path, "gateway": gateway, "url": f"http://127.0.0.1:{port}",
              "logs": tmp}
    try:
        yield handle
    finally:
        stop_process(gateway)
        cluster.kubectl("delete", "infsvc", "--all", "-n", ns, "--wait=false", check=False)
        stop_process(operator)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for name in ("gateway.log", "operator.log"):
            print(f"---- {name} (tail) ----\n" + "\n".join((tmp / name).read_text(errors="replace")
                                                            .splitlines()[-40:]))


def gateway_workers(url: str) -> dict[str, float]:
    """worker URL -> last probe up (1.0 / 0.0), from the gateway's own metrics."""
    try:
        text = httpx.get(url + "/pagefleet/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pagefleet_gateway_worker_up\{worker="([^"]+)"\} (\S+)$', text, re.M)}


def ready_pod_urls(cluster, ns: str) -> set[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagefleet.io/inference-service=smol")["items"]
    return {f"http://{p['status']['podIP']}:8000" for p in pods
            if p["metadata"].get("deletionTimestamp") is None and p.get("status", {}).get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])}


def test_scale_up_adds_and_pod_deletion_removes_workers_live(cluster, setup):
    ns, url, gateway = setup["ns"], setup["url"], setup["gateway"]
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "smol"},
            "spec": {"replicas": 1, "model": {"name": SERVED, "hostPath": {"path": setup["model_path"]}},
                     "resources": {"gpus": 0}, "engine": {"maxModelLen": 512, "maxNumSeqs": 2},
                     "drainSeconds": 2}}
    cluster.apply(yaml.safe_dump(body), namespace=ns)

    first = cluster.wait_for("one ready worker pod", lambda: ready_pod_urls(cluster, ns), timeout=READY_TIMEOUT)

    def up(want: set[str]):
        def check():
            workers = gateway_workers(url)
            return set(workers) == want and all(v == 1.0 for v in workers.values())
        return check

    cluster.wait_for(f"the gateway to list {first}", up(first), timeout=60)
    client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER_KEY, max_retries=0, timeout=120)
    answer = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3)
    assert answer.choices[0].text

    cluster.kubectl("scale", "infsvc", "smol", "-n", ns, "--replicas=2")
    def two_ready():
        urls = ready_pod_urls(cluster, ns)
        return urls if len(urls) == 2 else None

    both = cluster.wait_for("two ready worker pods", two_ready, timeout=READY_TIMEOUT)
    cluster.wait_for(f"the gateway to list both {both}", up(both), timeout=60)
    assert gateway.poll() is None, "the gateway restarted"
    served = set()
    deadline = time.time() + 60
    while served != both and time.time() < deadline:
        raw = client.completions.with_raw_response.create(model=SERVED, prompt="Hi", max_tokens=2)
        served.add(raw.headers["x-litellm-model-api-base"].removesuffix("/v1"))
    assert served == both, f"requests reached {served}, not both of {both}"

    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagefleet.io/inference-service=smol")["items"]
    victim = next(p for p in pods if f"http://{p['status']['podIP']}:8000" in both)
    victim_url = f"http://{victim['status']['podIP']}:8000"
    cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
    cluster.wait_for(f"the gateway to drop {victim_url}", lambda: victim_url not in gateway_workers(url), timeout=60)
    for _ in range(4):  # the survivor serves everything meanwhile
        raw = client.completions.with_raw_response.create(model=SERVED, prompt="Hi", max_tokens=2)
        assert raw.headers["x-litellm-model-api-base"].removesuffix("/v1") != victim_url
    assert gateway.poll() is None, "the gateway restarted"


def test_lora_adapters_swap_through_the_gateway(cluster, setup, tmp_path):
    """An InferenceService with a LoRA adapter behind the running gateway: the adapter is a model of the
    gateway's; editing spec.lora swaps it for another in the running pod, and the gateway follows (it
    watches the Services, whose adapters annotation the operator edits) without restarting."""
    from peft_adapters import make_adapters

    ns, url, gateway = setup["ns"], setup["url"], setup["gateway"]
    cluster.kubectl("delete", "infsvc", "smol", "-n", ns, "--wait=false", check=False)  # the CPU is for this one
    make_adapters(setup["model_path"], tmp_path / "adapters", [("terse", 0.05), ("chatty", 0.15)])
    lora = {"hostPath": {"path": str(tmp_path / "adapters")}}
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "lora"},
            "spec": {"replicas": 1, "model": {"name": "smol-base", "hostPath": {"path": setup["model_path"]}},
                     "resources": {"gpus": 0}, "engine": {"maxModelLen": 512, "maxNumSeqs": 2}, "drainSeconds": 2,
                     "lora": {**lora, "adapters": [{"name": "terse", "path": "terse"}]}}}
    cluster.apply(yaml.safe_dump(body), namespace=ns)
    client = openai.OpenAI(base_url=url + "/v1", api_key=MASTER_KEY, max_retries=0, timeout=120)

    def answers(model):
        try:
            return client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                             temperature=0).choices[0].text or None
        except openai.APIError:
            return None

    terse = cluster.wait_for("the gateway to serve terse", lambda: answers("terse"), timeout=READY_TIMEOUT)
    base = answers("smol-base")
    assert base and terse != base
    cluster.kubectl("patch", "infsvc", "lora", "-n", ns, "--type=merge", "-p",
                    '{"spec": {"lora": {"adapters": [{"name": "chatty", "path": "chatty"}]}}}')
    chatty = cluster.wait_for("the gateway to serve chatty", lambda: answers("chatty"), timeout=60)
    assert chatty not in (base, terse)
    cluster.wait_for("terse to be gone", lambda: answers("terse") is None, timeout=60)
    assert answers("smol-base") == base
    assert gateway.poll() is None, "the gateway restarted"
