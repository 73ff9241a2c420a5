"""The e2e cluster itself: real controllers acting on pods that the node agent runs as processes.

Manifests use a public python image and `python3` on PATH, so the same tests run on kind or a
real cluster (PAGEFLEET_E2E_KUBECONFIG); checks that look at local processes need the local one. One file
past 300 lines: every controller behaviour the operator relies on, checked against the one session cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent

HTTP_DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  labels: {app: web}
spec:
  replicas: 2
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
      - name: http
        image: python:3.12-slim
        command: ["python3", "-m", "http.server", "8000", "--bind", "$(POD_IP)"]
        env:
        - name: POD_IP
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        ports:
        - {name: http, containerPort: 8000}
        readinessProbe:
          httpGet: {path: /, port: http}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: http}
"""


@pytest.fixture
def namespace(cluster):
    """A namespace of its own per test, deleted afterwards (the namespace controller empties it)."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # Pods are admitted only once the ServiceAccount controller made the namespace's default SA.
    cluster.wait_for(f"serviceaccount {name}/default", lambda: cluster.kubectl(
        "get", "serviceaccount", "default", "-n", name, check=False).returncode == 0)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def ready_pods(cluster, namespace: str, selector: str) -> list[dict]:
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in pods if p["metadata"].get("deletionTimestamp") is None
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def http_get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return resp.status


def pid_of(pod: dict) -> int:
    """The node agent reports each container's process as containerID pagefleet://<pid>."""
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("pagefleet://"), container_id
    return int(container_id.removeprefix("pagefleet://"))


def process_exists(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_deployment_pods_become_ready_and_serve_on_their_own_ips(cluster, namespace):
    cluster.apply(HTTP_DEPLOYMENT, namespace)
    pods = cluster.wait_for("2 Ready pods of deployment web",
                            lambda: (lambda r: r if len(r) == 2 else None)(ready_pods(cluster, namespace, "app=web")),
                            timeout=90)
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 2, f"pod IPs not distinct: {ips}"
    if cluster.local:
        assert all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips), ips
        for ip in ips:
            assert http_get(f"http://{ip}:8000/") == 200
    # The EndpointSlice controller publishes both ready pods behind the Service.
    def slice_addresses():
        slices = cluster.kubectl_json("get", "endpointslices", "-n", namespace,
                                      "-l", "kubernetes.io/service-name=web")["items"]
        return sorted(a for s in slices for e in (s.get("endpoints") or [])
                      if e.get("conditions", {}).get("ready") for a in e["addresses"])
    assert cluster.wait_for("EndpointSlice of service web listing both pods",
                            lambda: (lambda a: a if a == sorted(ips) else None)(slice_addresses())) == sorted(ips)
    # The node agent serves container logs to the apiserver, so `kubectl logs` works.
    name = pods[0]["metadata"]["name"]
    cluster.wait_for("an access log line in kubectl logs",
                     lambda: '"GET / HTTP/1.1" 200' in cluster.pod_logs(namespace, name))


def test_deleting_deployment_garbage_collects_replicaset_pods_and_processes(cluster, namespace):
    cluster.apply(HTTP_DEPLOYMENT, namespace)
    pods = cluster.wait_for("2 Ready pods", lambda: (lambda r: r if len(r) == 2 else None)(
        ready_pods(cluster, namespace, "app=web")), timeout=90)
    assert cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=web")["items"]
    pids = [pid_of(p) for p in pods] if cluster.local else []
    assert all(process_exists(pid) for pid in pids)

    cluster.kubectl("delete", "deployment", "web", "-n", namespace, "--wait=false")
    # kubectl deletes in the background: the garbage collector follows ownerReferences
    # Deployment -> ReplicaSet -> Pods, and the node agent stops the pods' processes.
    cluster.wait_for("ReplicaSets of web to be garbage-collected", lambda: not cluster.kubectl_json(
        "get", "replicasets", "-n", namespace, "-l", "app=web")["items"], timeout=60)
    cluster.wait_for("pods of web to be gone", lambda: not cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", "app=web")["items"], timeout=60)
    for pid in pids:
        assert not process_exists(pid), f"pod process {pid} is still running"


def test_killed_container_process_is_restarted(cluster, namespace):
    if not cluster.local:
        pytest.skip("kills the pod's local process: needs the local e2e cluster")
    cluster.apply(HTTP_DEPLOYMENT.replace("replicas: 2", "replicas: 1"), namespace)
    pod = cluster.wait_for("a Ready pod", lambda: ready_pods(cluster, namespace, "app=web"), timeout=90)[0]
    name, old_pid = pod["metadata"]["name"], pid_of(pod)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0

    os.kill(old_pid, signal.SIGKILL)

    def restarted():
        p = cluster.kubectl_json("get", "pod", "-n", namespace, name)
        status = p["status"]["containerStatuses"][0]
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
        return p if status["restartCount"] >= 1 and ready else None
    pod = cluster.wait_for("the container to be restarted and Ready again", restarted, timeout=60)
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    assert pid_of(pod) != old_pid and process_exists(pid_of(pod))
    assert http_get(f"http://{pod['status']['podIP']}:8000/") == 200
    # Same pod, same IP: the restart happened inside the pod, not by replacing it.
    assert pod["metadata"]["name"] == name


def test_up_is_fast_with_cached_binaries_and_refuses_a_second_up(cluster):
    if not cluster.local:
        pytest.skip("measures the local cluster's `up`")
    print(f"\n[e2e] `up` with cached binaries took {cluster.up_seconds:.1f}s")
    assert cluster.up_seconds < 60, f"cluster up took {cluster.up_seconds:.1f}s"

    started = time.monotonic()
    second = subprocess.run([str(E2E_DIR / "cluster.sh"), "up", "--state-dir", str(cluster.state_dir)],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHON=sys.executable))
    assert second.returncode != 0
    assert "already running" in second.stderr, second.stderr
    assert time.monotonic() - started < 30  # refused up front, not after starting anything
    # ... and the running cluster is untouched.
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    assert [n["metadata"]["name"] for n in nodes] == ["pagefleet-node"]
    # `env` exports KUBECONFIG and a PATH holding kubectl and helm.
    env_out = subprocess.run([str(E2E_DIR / "cluster.sh"), "env", "--state-dir", str(cluster.state_dir)],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHON=sys.executable)).stdout
    assert f"export KUBECONFIG={cluster.kubeconfig}" in env_out
    helm = subprocess.run(["helm", "version", "--short"], capture_output=True, text=True,
                          env=dict(os.environ, **cluster.env))
    assert helm.returncode == 0 and helm.stdout.startswith("v3."), helm.stdout + helm.stderr


READINESS_DEPLOYMENT = HTTP_DEPLOYMENT.replace("replicas: 2", "replicas: 1").replace(
    "httpGet: {path: /, port: http}", "httpGet: {path: /ready.txt, port: http}\n          failureThreshold: 1")


def test_readiness_probe_drives_ready_condition_and_endpointslice(cluster, namespace):
    if not cluster.local:
        pytest.skip("flips readiness through the pod's local working directory")
    cluster.apply(READINESS_DEPLOYMENT, namespace)

    def pod_running():
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app=web")["items"]
        return pods[0] if pods and pods[0]["status"].get("phase") == "Running" else None
    name = cluster.wait_for("the pod to run", pod_running, timeout=60)["metadata"]["name"]

    def ready_and_slice():
        pod = cluster.kubectl_json("get", "pod", "-n", namespace, name)
        ready = [c["status"] for c in pod["status"]["conditions"] if c["type"] == "Ready"]
        slices = cluster.kubectl_json("get", "endpointslices", "-n", namespace,
                                      "-l", "kubernetes.io/service-name=web")["items"]
        in_slice = [e["conditions"].get("ready") for s in slices for e in (s.get("endpoints") or [])]
        return ready, in_slice
    # http.server serves the pod's working directory: /ready.txt answers 404 until it exists.
    time.sleep(3)
    assert ready_and_slice() == (["False"], [False])
    ready_file = cluster.pod_log_path(namespace, name, "http").parent / "ready.txt"
    ready_file.write_text("ok")
    cluster.wait_for("Ready=True and a ready EndpointSlice endpoint",
                     lambda: ready_and_slice() == (["True"], [True]), timeout=30)
    ready_file.unlink()
    cluster.wait_for("Ready=False again after the probe fails",
                     lambda: ready_and_slice() == (["False"], [False]), timeout=30)


ENV_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: envcheck
  labels: {role: check}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: python:3.12-slim
    command: ["sh", "-c"]
    args:
    - echo "ip=$POD_IP name=$POD_NAME ns=$POD_NS role=$ROLE greeting=$GREETING" 'literal=$$(POD_NAME)';
      kubectl auth whoami -o jsonpath='user={.status.userInfo.username}'
    env:
    - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
    - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: POD_NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
    - {name: ROLE, valueFrom: {fieldRef: {fieldPath: "metadata.labels['role']"}}}
    - {name: GREETING, value: "hello $(POD_NAME)"}
    resources:
      limits: {nvidia.com/gpu: 1}
"""


def test_gpu_pod_gets_downward_api_env_and_its_service_account(cluster, namespace):
    if not cluster.local:
        pytest.skip("runs kubectl inside the pod: needs the local node agent")
    cluster.apply(ENV_POD, namespace)
    pod = cluster.wait_for("pod envcheck to succeed", lambda: (lambda p: p if p["status"].get("phase") in (
        "Succeeded", "Failed") else None)(cluster.kubectl_json("get", "pod", "-n", namespace, "envcheck")),
        timeout=60)
    out = cluster.pod_logs(namespace, "envcheck")
    assert pod["status"]["phase"] == "Succeeded", out
    assert pod["spec"]["nodeName"] == "pagefleet-node"  # scheduled despite asking for a GPU
    ip = pod["status"]["podIP"]
    assert f"ip={ip} name=envcheck ns={namespace} role=check greeting=hello envcheck literal=$(POD_NAME)" in out
    # The agent gave the process a kubeconfig with a token bound to the pod's service account.
    assert f"user=system:serviceaccount:{namespace}:default" in out
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 0 and state["reason"] == "Completed"


def test_cli_up_then_down_leaves_no_process_behind(cluster, tmp_path):
    """A second cluster beside the session's, driven through cluster.sh exactly as by hand."""
    if not cluster.local:
        pytest.skip("starts a local cluster")
    state = tmp_path / "cluster"
    script = str(E2E_DIR / "cluster.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("KUBECONFIG", None)
    up = subprocess.run([script, "up", "--state-dir", str(state)], capture_output=True, text=True,
                        timeout=300, env=env)
    try:
        assert up.returncode == 0, up.stderr
        took = float(up.stderr.split("cluster up in ")[1].split("s")[0])
        print(f"\n[e2e] cluster.sh up (cached binaries) took {took:.1f}s")
        assert took < 60
        kube_env = dict(env, KUBECONFIG=str(state / "kubeconfig"))

        def kubectl(*args):
            return subprocess.run(["kubectl", *args], capture_output=True, text=True, env=kube_env,
                                  check=True).stdout
        kubectl("run", "sleeper", "--image=busybox", "--command", "--", "sleep", "300")
        pod_id = cluster.wait_for("pod sleeper to run", lambda: kubectl(
            "get", "pod", "sleeper", "-o", "jsonpath={.status.containerStatuses[0].containerID}"))
        session_ips = {p["status"].get("podIP") for p in cluster.kubectl_json("get", "pods", "-A")["items"]}
        assert kubectl("get", "pod", "sleeper", "-o", "jsonpath={.status.podIP}") not in session_ips
    finally:
        record = (state / "cluster.json").read_text() if (state / "cluster.json").exists() else "{}"
        down = subprocess.run([script, "down", "--state-dir", str(state)], capture_output=True, text=True,
                              timeout=120, env=env)
    assert down.returncode == 0, down.stderr
    pids = [p["pid"] for p in json.loads(record)["processes"]]
    assert len(pids) == 5  # etcd, apiserver, controller-manager, scheduler, node agent
    pids.append(int(pod_id.removeprefix("pagefleet://")))
    still = [pid for pid in pids if process_exists(pid)]
    assert not still, f"processes left behind by down: {still}"
    assert subprocess.run([script, "status", "--state-dir", str(state)], env=env).returncode == 1


LIVENESS_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: liveness
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: http
    image: python:3.12-slim
    command: ["python3", "-m", "http.server", "8000", "--bind", "$(POD_IP)"]
    env:
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    ports:
    - {name: http, containerPort: 8000}
    startupProbe:
      tcpSocket: {port: http}
      periodSeconds: 1
      failureThreshold: 30
    livenessProbe:
      httpGet: {path: /alive.txt, port: 8000}
      periodSeconds: 1
      failureThreshold: 2
"""


def test_failing_liveness_probe_restarts_the_container(cluster, namespace):
    """/alive.txt does not exist in the pod's working directory: after the startup probe passes,
    two failed liveness checks make the agent SIGTERM the process and start it again."""
    cluster.apply(LIVENESS_POD, namespace)

    def restarted_twice():
        pod = cluster.kubectl_json("get", "pod", "-n", namespace, "liveness")
        statuses = pod["status"].get("containerStatuses") or [{}]
        return pod if statuses[0].get("restartCount", 0) >= 2 else None
    pod = cluster.wait_for("two liveness restarts", restarted_twice, timeout=90)
    status = pod["status"]["containerStatuses"][0]
    assert pod["status"]["phase"] == "Running"
    if cluster.local:  # python3 -m http.server exits on SIGTERM: 128 + 15
        assert status["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGTERM


STUBBORN_POD = """
apiVersion: v1
kind: Pod
metadata:
  name: stubborn
spec:
  terminationGracePeriodSeconds: 3
  containers:
  - name: main
    image: busybox
    command: ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"]
"""


def test_deletion_escalates_to_sigkill_after_the_grace_period(cluster, namespace):
    cluster.apply(STUBBORN_POD, namespace)
    pod = cluster.wait_for("pod stubborn to run", lambda: (lambda p: p if p["status"].get("phase") == "Running"
                           else None)(cluster.kubectl_json("get", "pod", "-n", namespace, "stubborn")))
    pid = pid_of(pod) if cluster.local else None
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=true", timeout=60)
    took = time.monotonic() - started
    # The shell ignores SIGTERM, so only the SIGKILL after the 3 s grace period ends it.
    assert 3 <= took < 20, f"deletion took {took:.1f}s"
    if pid is not None:
        assert not process_exists(pid)
