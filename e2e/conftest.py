"""pytest integration of the e2e cluster: the session fixture `cluster`.

Every test under e2e/ is marked `e2e` (run them alone with `pytest -m e2e`). The fixture brings a
fresh cluster up in a temp state dir (building the binaries on the very first run), exports
KUBECONFIG and PATH for the session, and tears it down at the end. With PAGEFLEET_E2E_KUBECONFIG
set (to a kubeconfig path, or to 1 to take $KUBECONFIG) it uses that cluster instead: kind, a
real cluster. When an e2e test fails, the tail of every component's log is attached to its report
and the whole state dir (all logs) is kept and named in the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster as cluster_mod  # noqa: E402

E2E_DIR = Path(__file__).resolve().parent
# Covers the one-time Go build of the binaries (10-30 min on 2 cores), which happens inside
# the setup of whichever e2e test runs first.
E2E_TIMEOUT = 2700
_kept_state_dirs: list[str] = []
_timings: list[str] = []


class E2ECluster:
    """What tests (and other engineers' fixtures) get: see e2e/README.md."""

    def __init__(self, kubeconfig: str, env: dict[str, str], state_dir: Path | None,
                 up_seconds: float | None):
        self.kubeconfig = kubeconfig
        self.env = env                    # KUBECONFIG and PATH (kubectl, helm, ...)
        self.state_dir = state_dir        # None for an external cluster
        self.up_seconds = up_seconds      # time `up` took, binaries already built
        self.local = state_dir is not None

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl against the cluster; raises with its stderr when check and it fails."""
        done = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True,
                              env=dict(os.environ, **self.env), timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
        return done

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: str, namespace: str | None = None) -> None:
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=manifest)

    def pod_log_path(self, namespace: str, pod: str, container: str) -> Path:
        """The node agent's log file of a container (local cluster only; every restart appends)."""
        assert self.local, "pod log files exist only on the local cluster; use pod_logs()"
        uid = self.kubectl_json("get", "pod", "-n", namespace, pod)["metadata"]["uid"]
        return self.state_dir / "pods" / f"{namespace}_{pod}_{uid[:8]}" / f"{container}.log"

    def pod_logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's output, through `kubectl logs` (the node agent serves it)."""
        args = ["logs", "-n", namespace, pod] + (["-c", container] if container else [])
        return self.kubectl(*args).stdout

    def component_logs(self) -> dict[str, Path]:
        """etcd, kube-apiserver, kube-controller-manager, kube-scheduler, node-agent -> log file."""
        if not self.local:
            return {}
        return {p.stem: p for p in sorted((self.state_dir / "logs").glob("*.log"))}

    def wait_for(self, what: str, predicate, timeout: float = 60, interval: float = 0.5):
        """Poll predicate() until it returns something truthy; fail naming `what` on timeout."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _external_kubeconfig() -> str | None:
    value = os.environ.get("PAGEFLEET_E2E_KUBECONFIG")
    if not value:
        return None
    path = value if value not in ("1", "true", "yes") else os.environ.get("KUBECONFIG", "")
    if not path or not Path(path).exists():
        raise pytest.UsageError(f"PAGEFLEET_E2E_KUBECONFIG={value}: no kubeconfig at {path!r}")
    return path


@pytest.fixture(scope="session")
def cluster(request):
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    external = _external_kubeconfig()
    local = None
    if external:
        env = {"KUBECONFIG": external, "PATH": os.environ["PATH"]}
        handle = E2ECluster(external, env, None, None)
    else:
        local = cluster_mod.Cluster(tempfile.mkdtemp(prefix="pagefleet-e2e-"), die_with_parent=True)
        try:
            t0 = time.monotonic()
            cluster_mod.build_binaries()
            build_seconds = time.monotonic() - t0
            up_seconds = local.up()
        except cluster_mod.ClusterError as err:
            _keep(local)
            pytest.fail(f"e2e cluster did not come up: {err}", pytrace=False)
        _timings.append(f"e2e: binaries ready in {build_seconds:.1f}s; cluster up in {up_seconds:.1f}s "
                        f"(state dir {local.state})")
        print(f"\n[{_timings[-1]}]", file=sys.stderr)
        handle = E2ECluster(str(local.kubeconfig), local.env(), local.state, up_seconds)
    os.environ.update(handle.env)
    request.session.e2e_cluster = handle
    yield handle
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if local is not None:
        local.down()
        if getattr(request.session, "e2e_failed", False):
            _keep(local)
        else:
            shutil.rmtree(local.state, ignore_errors=True)


def _keep(local: cluster_mod.Cluster) -> None:
    _kept_state_dirs.append(str(local.state))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or item.get_closest_marker("e2e") is None:
        return
    item.session.e2e_failed = True
    handle = getattr(item.session, "e2e_cluster", None)
    if handle is None:
        return
    for name, path in handle.component_logs().items():
        tail = path.read_text(errors="replace").splitlines()[-40:]
        report.sections.append((f"e2e log: {name} (last 40 lines of {path})", "\n".join(tail)))


def pytest_terminal_summary(terminalreporter):
    for line in _timings:
        terminalreporter.write_line(line)
    for state in _kept_state_dirs:
        terminalreporter.write_line(f"e2e: cluster logs kept in {state}/logs (pod logs: {state}/pods)")
