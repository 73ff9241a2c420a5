"""A pod on the node agent: its containers as local processes, supervised by one thread.

The thread starts init containers in order, then the app containers; every tick it reaps exited
processes (restarting per restartPolicy with a short crash-loop backoff), runs due probes, and
patches the pod's status when what it would report has changed. Deletion (deletionTimestamp)
stops every container with SIGTERM, the grace period, then SIGKILL.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from pathlib import Path

import pod_env
from containers import Container, rfc3339
from kube_http import ApiError, KubeHTTP
from probes import run_probe

log = logging.getLogger("node-agent")

TICK_SECONDS = 0.5
MOUNT_RETRY_SECONDS = 2.0
# The kubelet backs off 10 s doubling to 5 min; tests want restarts visible in seconds.
BACKOFF_START, BACKOFF_MAX = 1.0, 20.0


class PodRuntime:
    def __init__(self, api: KubeHTTP, pod: dict, pod_ip: str, host_ip: str, pod_dir: Path,
                 base_env: dict[str, str], ca_file: str):
        self.api, self.pod, self.pod_ip, self.host_ip = api, pod, pod_ip, host_ip
        self.pod_dir, self.base_env, self.ca_file = pod_dir, base_env, ca_file
        meta = pod["metadata"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        self.uid = meta["uid"]
        self.restart_policy = pod["spec"].get("restartPolicy", "Always")
        pod_dir.mkdir(parents=True, exist_ok=True)

        def make(spec):
            return Container(spec, pod_dir / f"{spec['name']}.log", pod_dir / f"{spec['name']}.pid")

        self.init_containers = [make(c) for c in pod["spec"].get("initContainers", [])]
        self.containers = [make(c) for c in pod["spec"]["containers"]]
        self.start_time = rfc3339()
        self.phase = "Pending"
        self.message = ""
        self._stop_grace: float | None = None
        self._wake = threading.Event()
        self._last_status: dict | None = None
        self._ready_since: dict[bool, str] = {}
        self.thread = threading.Thread(target=self._run, name=f"pod {self.key}", daemon=True)

    # --- called from the agent's watch thread ----------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp") and self._stop_grace is None:
            self.request_stop(pod["metadata"].get("deletionGracePeriodSeconds", 30))

    def request_stop(self, grace_seconds: float) -> None:
        self._stop_grace = float(grace_seconds)
        self._wake.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop_grace is not None

    def log_path(self, container: str) -> Path:
        return self.pod_dir / f"{container}.log"

    # --- the pod's thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if not self._wait_for_mounts():
                return self._stop_all()
            self._prepare()
            if self._run_init_containers():
                while self._stop_grace is None:
                    self._tick()
                    self._wake.wait(TICK_SECONDS)
        except Exception as err:  # keep the agent alive; the pod shows the failure
            log.error("pod %s: %s\n%s", self.key, err, traceback.format_exc())
            self.phase, self.message = "Failed", f"node agent: {err}"
            self._push_status()
        self._stop_all()

    def _wait_for_mounts(self) -> bool:
        """Like the kubelet: a hostPath that fails its type check keeps the pod Pending (ContainerCreating)
        with a FailedMount event, retried until it appears or the pod goes away."""
        reported = None
        while self._stop_grace is None:
            failures = pod_env.hostpath_mount_failures(self.pod)
            if not failures:
                return True
            if failures[0] != reported:
                reported = failures[0]
                self._event("FailedMount", reported)
                self.phase, self.message = "Pending", reported
                self._push_status()
            self._wake.wait(MOUNT_RETRY_SECONDS)
        return False

    def _event(self, reason: str, message: str) -> None:
        meta = self.pod["metadata"]
        now = rfc3339()
        event = {
            "apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": message,
            "metadata": {"generateName": meta["name"] + ".", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                               "uid": self.uid},
            "source": {"component": "kubelet", "host": self.pod["spec"].get("nodeName", "")},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.api.create(f"/api/v1/namespaces/{meta['namespace']}/events", event)
        except ApiError as err:
            log.warning("pod %s: could not post event %s: %s", self.key, reason, err)

    def _prepare(self) -> None:
        pod = self.pod
        self.base_env = dict(self.base_env, HOSTNAME=pod["metadata"]["name"])
        self.base_env.update(pod_env.prepare_volumes(pod, self.pod_dir))
        # Right after binding, the Node authorizer's graph and NodeRestriction's pod cache may not
        # know the pod is ours yet (403 "no relationship found"): retry for a few seconds.
        for attempt in range(10):
            try:
                kubeconfig = pod_env.service_account_kubeconfig(self.api, pod, self.pod_dir, self.ca_file)
                if kubeconfig:
                    self.base_env["KUBECONFIG"] = kubeconfig
                break
            except ApiError as err:
                if err.status != 403 or attempt == 9:
                    log.warning("pod %s: no service-account token: %s", self.key, err)
                    break
                time.sleep(0.5)
        self._push_status()

    def _start(self, c: Container) -> None:
        # The downward API reads the IPs we assigned: a watch event may have replaced self.pod
        # with a version older than our first status patch.
        pod = dict(self.pod, status=dict(self.pod.get("status", {}), podIP=self.pod_ip,
                                         podIPs=[{"ip": self.pod_ip}], hostIP=self.host_ip))
        env = pod_env.container_env(self.api, pod, c.spec, self.base_env)
        argv = pod_env.container_argv(c.spec, env)
        c.start(argv, env, pod_env.working_dir(c.spec, self.pod_dir))
        log.info("pod %s: started %s (pid %d, restart %d): %s", self.key, c.name, c.proc.pid,
                 c.restart_count, " ".join(argv))

    def _run_init_containers(self) -> bool:
        for c in self.init_containers:
            failures = 0
            while self._stop_grace is None:
                self._start(c)
                self._push_status()
                while c.running() and self._stop_grace is None:
                    self._wake.wait(TICK_SECONDS)
                if self._stop_grace is not None:
                    return False
                c.reap()
                if c.current_termination["exitCode"] == 0:
                    break
                if self.restart_policy == "Never":
                    self.phase, self.message = "Failed", f"init container {c.name} failed"
                    self._push_status()
                    return False
                failures += 1
                self._wake.wait(min(BACKOFF_START * 2 ** failures, BACKOFF_MAX))
        if self._stop_grace is not None:
            return False
        for c in self.containers:
            self._start(c)
        self.phase = "Running"
        self._push_status()
        return True

    def _tick(self) -> None:
        now = time.monotonic()
        for c in self.containers:
            if c.reap():
                code = c.current_termination["exitCode"]
                log.info("pod %s: container %s exited with %d", self.key, c.name, code)
                self._schedule_restart(c, code, now)
            if c.restart_at is not None and now >= c.restart_at:
                self._start(c)
            if c.running():
                self._probe(c, now)
        if all(not c.running() and c.restart_at is None for c in self.containers):
            failed = any(c.current_termination and c.current_termination["exitCode"] != 0
                         for c in self.containers)
            self.phase = "Failed" if failed else "Succeeded"
        self._push_status()

    def _schedule_restart(self, c: Container, exit_code: int, now: float) -> None:
        policy = self.restart_policy
        if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
            return
        # A container that ran a while starts its backoff afresh, as the kubelet does.
        ran_for = now - c.started_mono
        streak = 0 if ran_for > 60 else max(c.restart_count, 0)
        c.restart_at = now + min(BACKOFF_START * 2 ** streak, BACKOFF_MAX)
        c.waiting_reason = "CrashLoopBackOff"
        c.last_termination, c.current_termination = c.current_termination, None

    def _probe(self, c: Container, now: float) -> None:
        startup = c.probes.get("startupProbe")
        order = ["startupProbe"] if startup and startup.verdict is not True else ["readinessProbe", "livenessProbe"]
        for kind in order:
            state = c.probes.get(kind)
            if state is None or not state.due(now):
                continue
            ok, message = run_probe(state.probe, c.spec, self.pod_ip, c.env)
            state.observe(ok, message, time.monotonic())
            if state.verdict is False and kind in ("startupProbe", "livenessProbe"):
                log.info("pod %s: %s of %s failed (%s); restarting it", self.key, kind, c.name, message)
                c.stop(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
                self._schedule_restart(c, c.current_termination["exitCode"], now)
                return

    # --- status ----------------------------------------------------------------------------
    def _condition(self, kind: str, ok: bool) -> dict:
        # lastTransitionTime changes only when the value does.
        key = (kind, ok)
        since = self._ready_since.setdefault(key, rfc3339())
        self._ready_since.pop((kind, not ok), None)
        return {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None,
                "lastTransitionTime": since}

    def _push_status(self) -> None:
        init_done = all(c.current_termination and c.current_termination["exitCode"] == 0
                        for c in self.init_containers)
        ready = self.phase == "Running" and all(c.ready() for c in self.containers)
        scheduled = [c for c in self.pod.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"]
        status = {
            "phase": self.phase,
            "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "conditions": scheduled + [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", init_done),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
            ],
            "initContainerStatuses": [c.status() for c in self.init_containers],
            "containerStatuses": [c.status() for c in self.containers],
            "message": self.message or None,
        }
        if status == self._last_status:
            return
        try:
            self.api.merge_patch(self.path + "/status", {"metadata": {"uid": self.uid}, "status": status})
            self._last_status = status
        except ApiError as err:
            # 404: deleted; 409: the name now belongs to a new pod (uid precondition).
            if err.status not in (404, 409):
                log.warning("pod %s: status update failed: %s", self.key, err)

    def _stop_all(self) -> None:
        """SIGTERM every container at once, give them the grace period together, then SIGKILL."""
        grace = self._stop_grace if self._stop_grace is not None else 0
        everyone = self.init_containers + self.containers
        for c in everyone:
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in everyone:
            c.stop(max(deadline - time.monotonic(), 0.1))
        log.info("pod %s: all containers stopped", self.key)
