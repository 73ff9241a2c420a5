"""charts/pagefleet with the real helm binary: lint, and what `helm template` renders for each option.

helm comes from PATH, else from e2e/build_binaries.sh, which builds it beside the control plane the first
time (from source, with Go) and hands back its cache at once afterwards. The lookup happens when the first
test runs, not at collection, so a fresh machine builds helm instead of skipping; only a machine without a
Go toolchain skips, and says so. One file past 300 lines: every chart option's rendering beside the two real
installs, which share the module's rendered manifests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pagefleet"
BUILD_BINARIES = ROOT / "e2e" / "build_binaries.sh"
NO_GO_TOOLCHAIN = 3  # build_binaries.sh's exit status when no Go toolchain is found
HELM = "helm"  # the binary's path, set by the `helm_binary` fixture before any test runs


def find_helm() -> str:
    """helm on PATH, else the one e2e/build_binaries.sh builds (or has cached); skips the test without Go."""
    found = shutil.which("helm")
    if found:
        return found
    # The build's progress goes to stderr, which pytest shows if the build fails.
    done = subprocess.run(["bash", str(BUILD_BINARIES)], stdout=subprocess.PIPE, text=True)
    if done.returncode == NO_GO_TOOLCHAIN:
        pytest.skip("no Go toolchain to build helm (e2e/build_binaries.sh needs Go >= 1.24 on PATH, at "
                    "/usr/local/go/bin/go or named by PAGEFLEET_GO), and no helm on PATH")
    if done.returncode != 0:
        pytest.fail(f"e2e/build_binaries.sh failed (exit {done.returncode}); its log is in the captured stderr",
                    pytrace=False)
    return str(Path(done.stdout.strip().splitlines()[-1]) / "helm")


@pytest.fixture(scope="module", autouse=True)
def helm_binary():
    global HELM
    HELM = find_helm()
    return HELM


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/pagefleet-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/pagefleet-helm/config", "HELM_DATA_HOME": "/tmp/pagefleet-helm/data"}
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120, env=env, check=check)


def render(*sets: str, include_crds: bool = True) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "pf-system"]
    if include_crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    out = helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_without_helm_or_go_the_lookup_skips_naming_go(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # bash and coreutils for build_binaries.sh
    if shutil.which("helm"):
        pytest.skip("helm is installed system-wide: the lookup never reaches the build")
    monkeypatch.setenv("PAGEFLEET_K8S_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setenv("PAGEFLEET_GO", str(tmp_path / "no-go"))
    with pytest.raises(pytest.skip.Exception, match="no Go toolchain"):
        find_helm()


def test_lint():
    result = helm("lint", str(CHART), "--strict", check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    result = helm("lint", str(CHART), "--strict", "--set", "gateway.enabled=true,gateway.masterKey=sk-test",
                  check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_install_is_crd_operator_and_cluster_rbac():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                            "ClusterRole", "ClusterRoleBinding", "Deployment"])
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "inferenceservices.pagefleet.io.yaml").read_text())
    (dep,) = by_kind(docs, "Deployment")
    assert dep["metadata"]["namespace"] == "pf-system"
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # a standalone operator never overlaps itself
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["pagefleet", "operator"]
    assert c["args"] == ["--liveness=http://$(POD_IP):8080/healthz"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["serviceAccountName"] == "rel-pagefleet-operator"
    binding = next(b for b in by_kind(docs, "ClusterRoleBinding") if b["roleRef"]["name"] == "rel-pagefleet-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-pagefleet-operator",
                                    "namespace": "pf-system"}]


def test_operator_rbac_is_least_privilege():
    docs = render()
    role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"] == "rel-pagefleet-operator")
    verbs = {(g, res): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
             for res in rule["resources"]}
    assert all("delete" not in v and "deletecollection" not in v and "*" not in v for v in verbs.values())
    assert verbs[("", "pods")] == {"get", "list", "watch"}
    assert verbs[("", "persistentvolumeclaims")] == {"get", "list", "watch"}
    assert verbs[("apps", "deployments")] == {"get", "list", "watch", "create", "patch"}
    assert ("", "secrets") not in verbs
    kopf_role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-kopf"))
    assert kopf_role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"],
                                   "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]}]


def test_watch_namespaces_gives_roles_instead_of_cluster_roles():
    docs = render("operator.watchNamespaces={team-a,team-b}", include_crds=False)
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == ["rel-pagefleet-operator-kopf"]
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_gateway_with_generated_secret():
    docs = render("gateway.enabled=true", "gateway.masterKey=sk-chart-test", include_crds=False)
    (secret,) = by_kind(docs, "Secret")
    assert secret["stringData"] == {"master-key": "sk-chart-test"}
    gw = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-pagefleet-gateway")
    (c,) = gw["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["pagefleet", "gateway"]
    assert "--kubernetes" in c["args"] and "--namespace=pf-system" in c["args"]
    assert "--host=$(POD_IP)" in c["args"]
    assert c["env"] == [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PAGEFLEET_MASTER_KEY", "valueFrom": {"secretKeyRef": {"name": "rel-pagefleet-gateway",
                                                                         "key": "master-key"}}}]
    role = next(r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "rel-pagefleet-gateway")
    assert role["rules"][0] == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                "verbs": ["list", "watch"]}
    assert role["rules"][1] == {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]}
    (svc,) = by_kind(docs, "Service")
    assert svc["spec"]["ports"][0]["port"] == 4000


def test_gateway_with_existing_secret_creates_none():
    docs = render("gateway.enabled=true", "gateway.existingSecret=my-keys", include_crds=False)
    assert by_kind(docs, "Secret") == []
    gw = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-pagefleet-gateway")
    ref = gw["spec"]["template"]["spec"]["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "my-keys", "key": "master-key"}


def test_gateway_without_a_key_is_refused_with_a_message():
    result = helm("template", "rel", str(CHART), "--set", "gateway.enabled=true", check=False)
    assert result.returncode != 0
    assert "gateway.masterKey" in result.stderr


def test_several_replicas_need_peering():
    result = helm("template", "rel", str(CHART), "--set", "operator.replicas=2", check=False)
    assert result.returncode != 0 and "operator.peering" in result.stderr
    docs = render("operator.replicas=2", "operator.peering=pagefleet", include_crds=False)
    (dep,) = by_kind(docs, "Deployment")
    assert "--peering=pagefleet" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    kopf_role = next(r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-kopf"))
    assert any("kopf.dev" in rule["apiGroups"] for rule in kopf_role["rules"])


def test_example_inference_services_from_values(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"inferenceServices": [{
        "name": "smollm2",
        "spec": {"model": {"name": "smollm2", "hostPath": {"path": "/mnt/nvme/smollm2"}},
                 "engine": {"gpuMemoryFraction": 0.35}, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
    }]}))
    out = helm("template", "rel", str(CHART), "--namespace", "serving", "-f", str(values)).stdout
    (isvc,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "InferenceService"]
    assert isvc["apiVersion"] == "pagefleet.io/v1alpha1"
    assert isvc["metadata"] == {"name": "smollm2", "namespace": "serving", "labels": isvc["metadata"]["labels"]}
    assert isvc["spec"]["engine"] == {"gpuMemoryFraction": 0.35}
    assert isvc["spec"]["model"]["hostPath"] == {"path": "/mnt/nvme/smollm2"}


# ---- helm install on the real control plane ------------------------------------------------------

@pytest.mark.e2e
def test_helm_install_runs_the_operator_with_its_own_rbac(cluster):
    """The chart's operator runs as a pod under its ServiceAccount and reconciles an InferenceService from values."""
    import json
    import time
    import uuid

    namespace = f"pf-chart-{uuid.uuid4().hex[:6]}"
    extra = cluster.env() if callable(cluster.env) else cluster.env
    env = {**os.environ, **extra, "KUBECONFIG": str(cluster.kubeconfig)}

    def kubectl(*args, check=True):  # the fixture's kubectl, with time for helm-installed objects
        return cluster.kubectl(*args, check=check, timeout=120)

    values = {
        "operator": {"watchNamespaces": [namespace], "statusIntervalSeconds": 1, "livenessPort": 18080},
        # Zero replicas: the operator's work (Deployment, Service, status) without loading a model.
        "inferenceServices": [{"name": "example", "spec": {
            "model": {"name": "example", "hostPath": {"path": "/nonexistent/example"}},
            "replicas": 0, "resources": {"gpus": 0}}}],
    }
    values_file = Path(f"/tmp/{namespace}-values.yaml")
    values_file.write_text(yaml.safe_dump(values))
    install = subprocess.run(
        [HELM, "install", "pf", str(CHART), "--namespace", namespace, "--create-namespace", "-f", str(values_file),
         "--wait", "--timeout", "5m"], capture_output=True, text=True, env=env, timeout=400)
    try:
        assert install.returncode == 0, install.stdout + install.stderr
        deadline = time.monotonic() + 180
        obj = {}
        while time.monotonic() < deadline:
            got = kubectl("get", "infsvc", "example", "-n", namespace, "-o", "json", check=False)
            obj = json.loads(got.stdout) if got.returncode == 0 else {}
            if (obj.get("status") or {}).get("phase") == "Stopped" and kubectl(
                    "get", "deployment", "example", "-n", namespace, check=False).returncode == 0:
                break
            time.sleep(2)
        else:
            logs = kubectl("logs", "-n", namespace, "deploy/pf-pagefleet-operator", "--tail=80", check=False)
            pytest.fail(f"the chart's operator did not reconcile: {obj.get('status')}\n{logs.stdout}{logs.stderr}")
        assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
        dep = json.loads(kubectl("get", "deployment", "example", "-n", namespace, "-o", "json").stdout)
        assert dep["spec"]["replicas"] == 0
        assert dep["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        # kopf's liveness endpoint answers on the pod IP, and the kubelet's probe has never restarted it.
        operator_pod = json.loads(kubectl("get", "pods", "-n", namespace, "-l",
                                          "app.kubernetes.io/name=pagefleet-operator", "-o", "json").stdout)["items"][0]
        assert all(cs["restartCount"] == 0 for cs in operator_pod["status"]["containerStatuses"])
        assert httpx.get(f"http://{operator_pod['status']['podIP']}:18080/healthz", timeout=10).status_code == 200
        # The ServiceAccount may do what the operator needs, and no more.
        sa = f"system:serviceaccount:{namespace}:pf-pagefleet-operator"
        for verb, resource, allowed in [("patch", "deployments.apps", "yes"), ("delete", "deployments.apps", "no"),
                                        ("get", "secrets", "no"), ("list", "pods", "yes"), ("delete", "pods", "no"),
                                        ("delete", "persistentvolumeclaims", "no")]:
            answer = kubectl("auth", "can-i", verb, resource, "-n", namespace, "--as", sa, check=False).stdout.strip()
            assert answer == allowed, (verb, resource, answer)

        # Uninstalling removes the operator and the InferenceService together; nothing waits on a finalizer.
        uninstall = subprocess.run([HELM, "uninstall", "pf", "--namespace", namespace, "--wait", "--timeout", "2m"],
                                   capture_output=True, text=True, env=env, timeout=200)
        assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = kubectl("get", "infsvc,deployments,services", "-n", namespace, "-o", "name").stdout.split()
            if not left:
                break
            time.sleep(1)
        assert not left, left
    finally:
        subprocess.run([HELM, "uninstall", "pf", "--namespace", namespace, "--wait", "--timeout", "2m"],
                       capture_output=True, text=True, env=env, timeout=200)
        subprocess.run(["kubectl", "delete", "namespace", namespace, "--wait=false"], capture_output=True, env=env)
        values_file.unlink(missing_ok=True)


@pytest.mark.e2e
def test_helm_install_with_gateway_answers_openai_requests(cluster):
    """The whole install path: chart → operator pod → worker pod → gateway pod, and an OpenAI client at the gateway."""
    import json
    import sys
    import time
    import uuid

    from openai import AuthenticationError, OpenAI

    code = "from pagefleet.worker.models.loader import bundled_model_path; print(bundled_model_path())"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert found.returncode == 0, found.stderr
    model_path = found.stdout.strip().splitlines()[-1]

    namespace = f"pf-gw-{uuid.uuid4().hex[:6]}"
    served = f"smol-{uuid.uuid4().hex[:4]}"
    master_key = f"sk-e2e-{uuid.uuid4().hex}"
    extra = cluster.env() if callable(cluster.env) else cluster.env
    env = {**os.environ, **extra, "KUBECONFIG": str(cluster.kubeconfig)}

    def kubectl(*args, check=True):  # the fixture's kubectl, with time for helm-installed objects
        return cluster.kubectl(*args, check=check, timeout=120)

    def wait(what, check, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(2)
        pods = kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        pytest.fail(f"timed out waiting for {what}\n{pods}")

    values = {
        "operator": {"watchNamespaces": [namespace], "statusIntervalSeconds": 1},
        "gateway": {"enabled": True, "masterKey": master_key},
        "inferenceServices": [{"name": "chat", "spec": {
            "model": {"name": served, "hostPath": {"path": model_path}},
            "resources": {"gpus": 0}, "engine": {"maxModelLen": 1024, "maxNumSeqs": 4}, "drainSeconds": 5}}],
    }
    values_file = Path(f"/tmp/{namespace}-values.yaml")
    values_file.write_text(yaml.safe_dump(values))
    try:
        install = subprocess.run(
            [HELM, "install", "pf", str(CHART), "--namespace", namespace, "--create-namespace", "-f", str(values_file),
             "--wait", "--timeout", "6m"], capture_output=True, text=True, env=env, timeout=420)
        assert install.returncode == 0, install.stdout + install.stderr

        def ready():
            got = kubectl("get", "infsvc", "chat", "-n", namespace, "-o", "json", check=False)
            obj = json.loads(got.stdout) if got.returncode == 0 else {}
            return obj if (obj.get("status") or {}).get("phase") == "Ready" else None

        wait("InferenceService chat Ready", ready, 600)
        gateway_ip = kubectl("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/name=pagefleet-gateway",
                             "-o", "jsonpath={.items[0].status.podIP}").stdout.strip()
        client = OpenAI(base_url=f"http://{gateway_ip}:4000/v1", api_key=master_key, timeout=120, max_retries=0)
        # The gateway learns the worker from the EndpointSlices of the operator's Service.
        wait("the gateway to list the model", lambda: served in [m.id for m in client.models.list().data], 120)
        answer = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0)
        assert answer.choices[0].message.content.strip()
        assert answer.usage.completion_tokens > 0
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"http://{gateway_ip}:4000/v1", api_key="sk-wrong", max_retries=0).models.list()
    finally:
        subprocess.run([HELM, "uninstall", "pf", "--namespace", namespace, "--wait", "--timeout", "2m"],
                       capture_output=True, text=True, env=env, timeout=200)
        subprocess.run(["kubectl", "delete", "namespace", namespace, "--wait=false"], capture_output=True, env=env)
        values_file.unlink(missing_ok=True)
