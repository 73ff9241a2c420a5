"""The InferenceService operator end to end, on the real control plane of e2e/ (pods are local processes).

The operator runs as a subprocess (`pagefleet operator --namespace NS`) with the cluster's kubeconfig,
as it would run from a terminal; the worker pods run the real `pagefleet serve` on the bundled model.
Tests run in file order and share one namespace and one operator process, which is why they stay in one
file past 300 lines: starting the operator and its workers again per file would cost minutes each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e

# Workers load a small model on CPU, several at a time on a small machine: allow minutes, not seconds.
READY_TIMEOUT = float(os.environ.get("PAGEFLEET_E2E_READY_TIMEOUT", "600"))


# ---- plumbing -----------------------------------------------------------------------------------

def cluster_env(cluster) -> dict[str, str]:
    """The environment a client of the test cluster runs with: KUBECONFIG, and PATH with its kubectl and helm."""
    extra = cluster.env() if callable(cluster.env) else cluster.env
    return {**os.environ, **extra, "KUBECONFIG": str(cluster.kubeconfig)}


def kubectl(cluster, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = cluster_env(cluster)
    result = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, env=env, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result


def get_json(cluster, *args: str) -> dict | None:
    result = kubectl(cluster, "get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def wait_for(what: str, check, timeout: float, interval: float = 1.0, on_timeout=None):
    """Calls check() until it returns something truthy; fails with `what` (and on_timeout's report) otherwise."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    report = on_timeout() if on_timeout else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{report}")


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def worker_processes(served_model_name: str) -> list[int]:
    """PIDs of local `pagefleet serve` processes serving this name (the node agent runs pods as processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "serve" in args and "--served-model-name" in args:
            if args[args.index("--served-model-name") + 1] == served_model_name:
                pids.append(int(entry.name))
    return pids


class Operator:
    """`pagefleet operator` as a subprocess; restartable, with its log kept for failure reports."""

    def __init__(self, cluster, namespace: str, log_path: Path):
        self.cluster, self.namespace, self.log_path = cluster, namespace, log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**cluster_env(self.cluster),
               "PAGEFLEET_STATUS_INTERVAL": "1", "PAGEFLEET_AUTOSCALE_INTERVAL": "2", "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "a")
        log.write(f"\n==== operator start {time.strftime('%H:%M:%S')} ====\n")
        log.flush()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagefleet", "operator", "--namespace", self.namespace, "--verbose"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        log.close()

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to finish what it was doing."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "---- operator log (tail) ----\n" + "\n".join(text.splitlines()[-lines:])


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled_model() -> str:
    """The bundled SmolLM2 as a checkpoint folder on this 'node' (converted once by the worker's loader)."""
    code = "from pagefleet.worker.models.loader import bundled_model_path; print(bundled_model_path())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def crd(cluster):
    kubectl(cluster, "apply", "--server-side", "-f", str(ROOT / "crds"))
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s",
            "crd/inferenceservices.pagefleet.io")
    return "inferenceservices.pagefleet.io"


@pytest.fixture(scope="module")
def namespace(cluster, crd):
    name = f"pf-op-{uuid.uuid4().hex[:6]}"
    kubectl(cluster, "create", "namespace", name)
    yield name
    kubectl(cluster, "delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(cluster, namespace, tmp_path_factory):
    op = Operator(cluster, namespace, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(op.log_tail(200))


def inference_service(name: str, model_path: str, served: str, **spec) -> dict:
    body = {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": served, "hostPath": {"path": model_path}},
            # No GPU here: the worker runs on CPU. Small limits keep several workers within 2 cores.
            "resources": {"gpus": 0},
            "engine": {"maxModelLen": 1024, "maxNumSeqs": 4},
            "drainSeconds": 5,
        },
    }
    body["spec"].update(spec)
    return body


def apply(cluster, namespace: str, body: dict) -> subprocess.CompletedProcess:
    return kubectl(cluster, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body), check=False)


def wait_ready(cluster, namespace: str, name: str, operator: Operator, replicas: int = 1,
               timeout: float = READY_TIMEOUT) -> dict:
    def ready():
        obj = get_json(cluster, "infsvc", name, "-n", namespace)
        if not obj:
            return None
        st = obj.get("status") or {}
        if (condition(obj, "Ready").get("status") == "True" and st.get("readyReplicas") == replicas
                and len(st.get("endpoints") or []) == replicas and st.get("phase") == "Ready"
                and st.get("observedGeneration") == obj["metadata"]["generation"]):
            return obj
        return None

    def report():
        obj = get_json(cluster, "infsvc", name, "-n", namespace)
        pods = kubectl(cluster, "get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        return f"status: {json.dumps((obj or {}).get('status'), indent=1)}\npods:\n{pods}\n{operator.log_tail()}"

    return wait_for(f"{name} Ready with {replicas} endpoint(s)", ready, timeout, interval=2, on_timeout=report)


def children(cluster, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = f"pagefleet.io/inference-service={name}"
    found = {}
    for kind in ("deployments", "replicasets", "services", "pods", "endpointslices"):
        found[kind] = (get_json(cluster, kind, "-n", namespace, "-l", selector) or {}).get("items", [])
    return found


# ---- 2. the API server refuses bad specs ----------------------------------------------------------

BAD_SPECS = [
    ("two model sources",
     {"model": {"name": "m", "hostPath": {"path": "/models/m"}, "pvc": {"claimName": "w"}}},
     "spec.model needs exactly one source"),
    ("no model source", {"model": {"name": "m"}}, "spec.model needs exactly one source"),
    ("min above max",
     {"model": {"name": "m", "hostPath": {"path": "/m"}}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas must be less than or equal to maxReplicas"),
    ("gpuMemoryFraction 2",
     {"model": {"name": "m", "hostPath": {"path": "/m"}}, "engine": {"gpuMemoryFraction": 2}},
     "spec.engine.gpuMemoryFraction"),
    ("gpuMemoryFraction 0",
     {"model": {"name": "m", "hostPath": {"path": "/m"}}, "engine": {"gpuMemoryFraction": 0}},
     "spec.engine.gpuMemoryFraction"),
    ("relative hostPath", {"model": {"name": "m", "hostPath": {"path": "models/m"}}},
     "spec.model.hostPath.path must be an absolute path"),
    ("relative kernel cache path",
     {"model": {"name": "m", "hostPath": {"path": "/m"}}, "kernelCache": {"hostPath": {"path": "cache"}}},
     "spec.kernelCache.hostPath.path must be an absolute path"),
    ("bad memory quantity",
     {"model": {"name": "m", "hostPath": {"path": "/m"}}, "resources": {"memory": "lots"}},
     "spec.resources.memory must be a Kubernetes quantity"),
    ("two adapters of one name",
     {"model": {"name": "m", "hostPath": {"path": "/m"}},
      "lora": {"hostPath": {"path": "/a"}, "adapters": [{"name": "x", "path": "x1"}, {"name": "x", "path": "x2"}]}},
     "spec.lora.adapters names must be unique"),
    ("adapter named as the model",
     {"model": {"name": "m", "hostPath": {"path": "/m"}},
      "lora": {"hostPath": {"path": "/a"}, "adapters": [{"name": "m", "path": "x"}]}},
     "spec.lora.adapters names must differ from spec.model.name"),
    ("adapter path escaping its source",
     {"model": {"name": "m", "hostPath": {"path": "/m"}},
      "lora": {"pvc": {"claimName": "c"}, "adapters": [{"name": "x", "path": "../x"}]}},
     "spec.lora.adapters[].path must be relative"),
    ("fewer slots than adapters",
     {"model": {"name": "m", "hostPath": {"path": "/m"}},
      "lora": {"hostPath": {"path": "/a"}, "maxLoras": 1,
               "adapters": [{"name": "x", "path": "x"}, {"name": "z", "path": "z"}]}},
     "spec.lora.maxLoras must be at least the number of adapters"),
]


@pytest.mark.parametrize("what, spec, message", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_api_server_refuses_invalid_specs(cluster, namespace, what, spec, message):
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "bad-" + uuid.uuid4().hex[:6]}, "spec": spec}
    result = apply(cluster, namespace, body)
    assert result.returncode != 0, f"{what}: accepted"
    assert "is invalid" in result.stderr and message in result.stderr, result.stderr
    assert get_json(cluster, "infsvc", body["metadata"]["name"], "-n", namespace) is None


def test_valid_spec_gets_defaults(cluster, namespace):
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "defaults"},
            "spec": {"model": {"name": "m", "hostPath": {"path": "/m"}},
                     "autoscaling": {"maxReplicas": 3}, "resources": {"cpu": 2, "memory": "1Gi"},
                     "lora": {"pvc": {"claimName": "adapters"},
                              "adapters": [{"name": "sql", "path": "sql"}, {"name": "de", "path": "de/v1"}]}}}
    result = kubectl(cluster, "apply", "-n", namespace, "--dry-run=server", "-o", "json", "-f", "-",
                     input=yaml.safe_dump(body))
    spec = json.loads(result.stdout)["spec"]
    assert spec["replicas"] == 1
    assert spec["autoscaling"] == {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 4,
                                   "scaleDownDelaySeconds": 300}
    assert spec["resources"] == {"gpus": 1, "cpu": 2, "memory": "1Gi"}
    assert spec["image"] and spec["drainSeconds"] == 60
    assert [a["name"] for a in spec["lora"]["adapters"]] == ["sql", "de"]  # the LoRA rules accept a valid list


# ---- 2. a valid InferenceService serves the model -------------------------------------------------

SERVED = f"smol-{uuid.uuid4().hex[:4]}"


def test_inference_service_becomes_ready_and_answers(cluster, namespace, operator, bundled_model):
    result = apply(cluster, namespace, inference_service("smol", bundled_model, SERVED))
    assert result.returncode == 0, result.stderr
    obj = wait_ready(cluster, namespace, "smol", operator)

    st = obj["status"]
    # No finalizer: deleting never waits for the operator (children go by garbage collection).
    assert not obj["metadata"].get("finalizers")
    assert condition(obj, "ModelSourceAvailable")["status"] == "True"
    assert condition(obj, "Progressing")["status"] == "False"
    assert st["selector"] == "pagefleet.io/inference-service=smol"
    (endpoint,) = st["endpoints"]
    assert endpoint.startswith("http://127.") and endpoint.endswith(":8000")

    # Children: one Deployment and one Service, both controlled by the InferenceService.
    kids = children(cluster, namespace, "smol")
    assert len(kids["deployments"]) == 1 and len(kids["services"]) == 1
    for child in kids["deployments"] + kids["services"]:
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceService", "smol", obj["metadata"]["uid"], True)
    container = kids["deployments"][0]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--max-num-seqs") + 1] == "4"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True and mount["mountPath"] == bundled_model
    # The EndpointSlice the gateway reads lists the ready pod.
    addresses = {a for s in kids["endpointslices"] for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert endpoint.split("//")[1].split(":")[0] in addresses

    # kubectl's printer columns.
    table = kubectl(cluster, "get", "infsvc", "smol", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "READY", "DESIRED", "PHASE", "AGE"]
    assert row.split()[:5] == ["smol", SERVED, "1", "1", "Ready"]

    # The OpenAI client, straight at the worker endpoint.
    from openai import OpenAI

    client = OpenAI(base_url=f"{endpoint}/v1", api_key="unused", timeout=120, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED]
    answer = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    text = answer.choices[0].message.content
    assert text and text.strip(), answer
    assert answer.usage.completion_tokens > 0


# ---- 3. an engine change rolls the pods ----------------------------------------------------------

def test_changing_max_num_seqs_rolls_pods_with_the_new_flag(cluster, namespace, operator):
    before = {p["metadata"]["name"] for p in children(cluster, namespace, "smol")["pods"]}
    kubectl(cluster, "patch", "infsvc", "smol", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 6}}}))
    obj = wait_ready(cluster, namespace, "smol", operator)
    pods = [p for p in children(cluster, namespace, "smol")["pods"] if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1 and pods[0]["metadata"]["name"] not in before
    args = pods[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "6"
    # The running worker itself reports the new limit.
    (endpoint,) = obj["status"]["endpoints"]
    assert httpx.get(f"{endpoint}/load", timeout=10).json()["max_num_seqs"] == 6
    wait_for("old pods gone", lambda: not before & {p["metadata"]["name"]
                                                     for p in children(cluster, namespace, "smol")["pods"]}, 120)


# ---- 5. a restart mid-reconcile converges --------------------------------------------------------

def test_operator_restart_mid_reconcile_converges(cluster, namespace, operator):
    offset = operator.log_path.stat().st_size
    kubectl(cluster, "patch", "infsvc", "smol", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 5}}}))
    # SIGKILL the moment the update handler starts: it dies between reading the spec and recording the result.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "Handler 'reconcile' is invoked" not in operator.log_since(offset):
        time.sleep(0.005)
    operator.kill()
    interrupted = "Handler 'reconcile' succeeded" not in operator.log_since(offset)
    print(f"operator killed {'inside' if interrupted else 'just after'} the update handler")
    time.sleep(2)
    operator.start()
    obj = wait_ready(cluster, namespace, "smol", operator)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]

    def settled():
        kids = children(cluster, namespace, "smol")
        live = [p for p in kids["pods"] if not p["metadata"].get("deletionTimestamp")]
        return kids if len(live) == len(kids["pods"]) == 1 else None

    kids = wait_for("one live pod and no terminating ones", settled, 180, interval=2)
    assert len(kids["deployments"]) == 1 and len(kids["services"]) == 1
    (dep,) = kids["deployments"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "5"
    # Every ReplicaSet belongs to the one Deployment, every pod to one of those ReplicaSets: no orphans.
    rs_names = set()
    for rs in kids["replicasets"]:
        (ref,) = rs["metadata"]["ownerReferences"]
        assert ref["uid"] == dep["metadata"]["uid"]
        rs_names.add(rs["metadata"]["name"])
    for pod in kids["pods"]:
        (ref,) = pod["metadata"]["ownerReferences"]
        assert ref["kind"] == "ReplicaSet" and ref["name"] in rs_names
    everything = get_json(cluster, "deployments,services", "-n", namespace) or {}
    assert sorted(i["metadata"]["name"] for i in everything["items"]) == ["smol", "smol"]


# ---- 3. deleting removes every child and process --------------------------------------------------

def test_deleting_removes_every_child_and_process(cluster, namespace, operator):
    assert worker_processes(SERVED), "the worker process should be running before the delete"
    kubectl(cluster, "delete", "infsvc", "smol", "-n", namespace, "--wait=true", "--timeout=120s")

    def gone():
        kids = children(cluster, namespace, "smol")
        left = {k: [i["metadata"]["name"] for i in v] for k, v in kids.items() if v}
        return "gone" if not left and not worker_processes(SERVED) else None

    wait_for("children and worker processes gone", gone, 180, interval=2,
             on_timeout=lambda: f"{children(cluster, namespace, 'smol')} pids={worker_processes(SERVED)}")


# ---- LoRA adapters from spec.lora -----------------------------------------------------------------

def test_lora_adapters_are_served_by_name_and_swapped_without_restarts(cluster, namespace, operator, bundled_model,
                                                                      tmp_path):
    """PEFT adapters for the bundled model on the node's disk, named in spec.lora: the operator loads them
    into the running worker, which serves each as its own model, and the Service tells the gateway so.
    Editing the list later loads and unloads adapters in the same pod: no rollout, no restart."""
    from peft_adapters import make_adapters

    make_adapters(bundled_model, tmp_path / "adapters", [("terse", 0.05), ("chatty", 0.15)])
    served = f"smol-lora-{uuid.uuid4().hex[:4]}"
    source = {"hostPath": {"path": str(tmp_path / "adapters")}}
    body = inference_service("lora", bundled_model, served,
                             lora={**source, "adapters": [{"name": "terse", "path": "terse"}]})
    assert apply(cluster, namespace, body).returncode == 0
    try:
        obj = wait_ready(cluster, namespace, "lora", operator)
        (endpoint,) = obj["status"]["endpoints"]
        (svc,) = children(cluster, namespace, "lora")["services"]
        assert svc["metadata"]["annotations"]["pagefleet.io/lora-adapters"] == "terse"
        from openai import OpenAI

        client = OpenAI(base_url=f"{endpoint}/v1", api_key="unused", timeout=120, max_retries=0)

        def models():
            return sorted(m.id for m in client.models.list().data)

        def lora_status():
            return ((get_json(cluster, "infsvc", "lora", "-n", namespace) or {}).get("status") or {}).get("lora")

        wait_for("the operator to load terse", lambda: models() == sorted([served, "terse"]), 60,
                 on_timeout=lambda: f"{lora_status()}\n{operator.log_tail()}")
        wait_for("status.lora in sync", lambda: lora_status() == {"adapters": 1, "workersInSync": "1/1", "message": ""},
                 30, on_timeout=lora_status)
        header, row = kubectl(cluster, "get", "infsvc", "lora", "-n", namespace, "-o", "wide").stdout.splitlines()
        assert dict(zip(header.split(), row.split()))["LORA"] == "1/1"

        def ask(model):
            return client.completions.create(model=model, prompt="The capital of France is", max_tokens=12,
                                             temperature=0).choices[0].text

        base_text, adapted = ask(served), ask("terse")
        assert adapted and adapted != base_text, (base_text, adapted)  # the adapter is applied, not ignored

        (pod,) = children(cluster, namespace, "lora")["pods"]
        # swap: chatty in, terse out, in the running pod
        kubectl(cluster, "patch", "infsvc", "lora", "-n", namespace, "--type=merge",
                "-p", json.dumps({"spec": {"lora": {"adapters": [{"name": "chatty", "path": "chatty"}]}}}))
        wait_for("the operator to swap terse for chatty", lambda: models() == sorted([served, "chatty"]), 60,
                 on_timeout=lambda: f"{lora_status()}\n{operator.log_tail()}")
        chatty = ask("chatty")
        assert chatty and chatty not in (base_text, adapted), (base_text, adapted, chatty)
        wait_for("status.lora in sync", lambda: lora_status() == {"adapters": 1, "workersInSync": "1/1", "message": ""},
                 30, on_timeout=lora_status)
        kids = children(cluster, namespace, "lora")
        (same,) = kids["pods"]
        assert same["metadata"]["uid"] == pod["metadata"]["uid"]  # no rollout
        assert all(cs.get("restartCount", 0) == 0 for cs in same["status"].get("containerStatuses") or [])
        assert len(kids["replicasets"]) == 1
        assert kids["services"][0]["metadata"]["annotations"]["pagefleet.io/lora-adapters"] == "chatty"
        # an adapter the worker cannot load: status.lora says which and why, the served ones stay served
        kubectl(cluster, "patch", "infsvc", "lora", "-n", namespace, "--type=merge", "-p", json.dumps(
            {"spec": {"lora": {"adapters": [{"name": "chatty", "path": "chatty"},
                                            {"name": "nothing", "path": "nothing"}]}}}))
        broken = wait_for("status.lora to report the bad adapter",
                          lambda: (lora_status() or {}).get("message") and lora_status(), 30, on_timeout=lora_status)
        assert broken["workersInSync"] == "0/1" and "nothing on " in broken["message"], broken
        assert ask("chatty") == chatty
    finally:
        kubectl(cluster, "delete", "infsvc", "lora", "-n", namespace, "--wait=true", "--timeout=120s", check=False)


# ---- a missing model source is a status, not a crash loop -----------------------------------------

def test_missing_pvc_reports_model_source_unavailable(cluster, namespace, operator):
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "nopvc"},
            "spec": {"model": {"name": "m", "pvc": {"claimName": "no-such-claim", "subPath": "m"}},
                     "resources": {"gpus": 0}}}
    assert apply(cluster, namespace, body).returncode == 0

    def failed():
        obj = get_json(cluster, "infsvc", "nopvc", "-n", namespace)
        cond = condition(obj or {}, "ModelSourceAvailable")
        return obj if cond.get("status") == "False" and obj["status"].get("phase") == "Failed" else None

    obj = wait_for("ModelSourceAvailable=False", failed, 60, on_timeout=operator.log_tail)
    cond = condition(obj, "ModelSourceAvailable")
    assert cond["reason"] == "ClaimNotFound" and "no-such-claim" in cond["message"]
    assert condition(obj, "Ready")["reason"] == "ModelSourceUnavailable"
    # The pod waits unscheduled: nothing restarts in a loop.
    for pod in children(cluster, namespace, "nopvc")["pods"]:
        assert pod["status"].get("phase") == "Pending"
        assert all(cs.get("restartCount", 0) == 0 for cs in pod["status"].get("containerStatuses") or [])

    # The claim appears: the condition clears without touching the InferenceService.
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "no-such-claim"},
             "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}
    kubectl(cluster, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(claim))
    wait_for("ModelSourceAvailable no longer False",
             lambda: condition(get_json(cluster, "infsvc", "nopvc", "-n", namespace), "ModelSourceAvailable")
             .get("reason") != "ClaimNotFound", 60)
    kubectl(cluster, "delete", "infsvc", "nopvc", "-n", namespace, "--wait=true", "--timeout=60s")
    # The user's claim is never the operator's to delete.
    assert get_json(cluster, "pvc", "no-such-claim", "-n", namespace) is not None


def test_missing_host_path_reports_model_source_unavailable(cluster, namespace, operator, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    assert apply(cluster, namespace, inference_service("nohostpath", missing, "m")).returncode == 0

    def failed():
        obj = get_json(cluster, "infsvc", "nohostpath", "-n", namespace)
        cond = condition(obj or {}, "ModelSourceAvailable")
        return obj if cond.get("status") == "False" else None

    obj = wait_for("ModelSourceAvailable=False", failed, 90, on_timeout=operator.log_tail)
    cond = condition(obj, "ModelSourceAvailable")
    assert cond["reason"] == "MountFailed" and missing in cond["message"] and "not a directory" in cond["message"]
    # The node refuses the mount (FailedMount), so the worker never starts: no crash loop.
    for pod in children(cluster, namespace, "nohostpath")["pods"]:
        assert pod["status"].get("phase") == "Pending"
        assert all(cs.get("restartCount", 0) == 0 for cs in pod["status"].get("containerStatuses") or [])
    kubectl(cluster, "delete", "infsvc", "nohostpath", "-n", namespace, "--wait=true", "--timeout=60s")


# ---- kubectl scale, autoscaling off --------------------------------------------------------------

def test_kubectl_scale_sets_deployment_replicas(cluster, namespace, operator):
    body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "scaled"},
            "spec": {"model": {"name": "m", "hostPath": {"path": "/nonexistent/model"}}, "replicas": 0,
                     "resources": {"gpus": 0}}}
    assert apply(cluster, namespace, body).returncode == 0
    wait_for("phase Stopped", lambda: (get_json(cluster, "infsvc", "scaled", "-n", namespace) or {})
             .get("status", {}).get("phase") == "Stopped", 60, on_timeout=operator.log_tail)
    kubectl(cluster, "scale", "infsvc", "scaled", "-n", namespace, "--replicas=2")
    wait_for("Deployment at 2 replicas",
             lambda: (get_json(cluster, "deployment", "scaled", "-n", namespace) or {}).get("spec", {})
             .get("replicas") == 2, 60, on_timeout=operator.log_tail)
    kubectl(cluster, "scale", "infsvc", "scaled", "-n", namespace, "--replicas=0")
    wait_for("Deployment back at 0",
             lambda: (get_json(cluster, "deployment", "scaled", "-n", namespace) or {}).get("spec", {})
             .get("replicas") == 0, 60, on_timeout=operator.log_tail)
    kubectl(cluster, "delete", "infsvc", "scaled", "-n", namespace, "--wait=true", "--timeout=60s")


# ---- 4. queue-depth autoscaling ------------------------------------------------------------------

class Load:
    """Concurrent streaming-free completions against the given endpoints, until stopped (bounded)."""

    def __init__(self, endpoints_fn, model: str, concurrency: int, max_seconds: float):
        self.endpoints_fn, self.model = endpoints_fn, model
        self.concurrency, self.deadline = concurrency, time.monotonic() + max_seconds
        self.stop_flag = threading.Event()
        self.sent = self.ok = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=300, trust_env=False) as client:
            while not self.stop_flag.is_set() and time.monotonic() < self.deadline:
                urls = self.endpoints_fn()
                if not urls:
                    time.sleep(0.5)
                    continue
                url = urls[i % len(urls)]
                self.sent += 1
                try:
                    r = client.post(f"{url}/v1/completions", json={
                        "model": self.model, "prompt": f"Count slowly from {i} upward:", "max_tokens": 48,
                        "temperature": 0, "ignore_eos": True})
                    self.ok += r.status_code == 200
                except httpx.HTTPError:
                    time.sleep(0.2)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=330)


def test_queue_depth_scales_up_to_max_and_back_to_min(cluster, namespace, operator, bundled_model):
    served = f"busy-{uuid.uuid4().hex[:4]}"
    body = inference_service("busy", bundled_model, served,
                             engine={"maxModelLen": 512, "maxNumSeqs": 1},
                             autoscaling={"minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 1,
                                          "scaleDownDelaySeconds": 20})
    assert apply(cluster, namespace, body).returncode == 0
    wait_ready(cluster, namespace, "busy", operator, replicas=1)

    def endpoints():
        obj = get_json(cluster, "infsvc", "busy", "-n", namespace) or {}
        return (obj.get("status") or {}).get("endpoints") or []

    cached = {"urls": endpoints(), "at": time.monotonic()}

    def endpoints_cached():
        if time.monotonic() - cached["at"] > 3:
            cached.update(urls=endpoints(), at=time.monotonic())
        return cached["urls"]

    # One sequence at a time per worker and 8 clients: about 7 requests wait on one pod, target 1.
    with Load(endpoints_cached, served, concurrency=8, max_seconds=READY_TIMEOUT + 120) as load:
        wait_for("spec.replicas at maxReplicas (2)",
                 lambda: (get_json(cluster, "infsvc", "busy", "-n", namespace) or {}).get("spec", {})
                 .get("replicas") == 2, 120, interval=2, on_timeout=operator.log_tail)
        wait_ready(cluster, namespace, "busy", operator, replicas=2)
        assert load.ok > 0
    obj = get_json(cluster, "infsvc", "busy", "-n", namespace)
    scaled_up_at = obj["status"]["lastScaleTime"]
    assert obj["status"]["autoscaling"]["desiredReplicas"] == 2

    # Load gone: after scaleDownDelaySeconds of empty queues, back to minReplicas.
    wait_for("spec.replicas back at minReplicas (1)",
             lambda: (get_json(cluster, "infsvc", "busy", "-n", namespace) or {}).get("spec", {})
             .get("replicas") == 1, 180, interval=2, on_timeout=operator.log_tail)
    obj = wait_ready(cluster, namespace, "busy", operator, replicas=1)
    assert obj["status"]["lastScaleTime"] > scaled_up_at
    assert obj["status"]["autoscaling"]["desiredReplicas"] == 1

    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=busy")["items"]
    reasons = [e["reason"] for e in events]
    assert "ScaledUp" in reasons and "ScaledDown" in reasons, reasons
    up = next(e for e in events if e["reason"] == "ScaledUp")
    assert "replicas 1 -> 2" in up["message"] and "queue depth" in up["message"]
    kubectl(cluster, "delete", "infsvc", "busy", "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for("busy workers gone", lambda: not worker_processes(served), 120)


# ---- the other way to run it ---------------------------------------------------------------------

def test_kopf_run_module_entry_point(cluster, crd, tmp_path):
    """`kopf run -m pagefleet.operator` registers the same handlers as `pagefleet operator`."""
    ns = f"pf-kopf-{uuid.uuid4().hex[:6]}"
    kubectl(cluster, "create", "namespace", ns)
    log_path = tmp_path / "kopf.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-m", "pagefleet.operator", "--standalone", "--namespace", ns],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**cluster_env(cluster), "PAGEFLEET_STATUS_INTERVAL": "1"})
    try:
        body = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "idle"},
                "spec": {"model": {"name": "idle", "hostPath": {"path": "/nonexistent/idle"}}, "replicas": 0}}
        assert apply(cluster, ns, body).returncode == 0
        obj = wait_for("phase Stopped from kopf run", lambda: (lambda o: o if (o or {}).get("status", {}).get(
            "phase") == "Stopped" else None)(get_json(cluster, "infsvc", "idle", "-n", ns)), 90,
            on_timeout=lambda: log_path.read_text()[-3000:])
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
        assert get_json(cluster, "deployment", "idle", "-n", ns)["spec"]["replicas"] == 0
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        kubectl(cluster, "delete", "namespace", ns, "--wait=false", check=False)
