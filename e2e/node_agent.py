"""pagefleet's test-only stand-in for the kubelet: pods bound to its Node run as local processes.

It registers a Ready Node (capacity includes nvidia.com/gpu so GPU pods schedule), renews the
node's Lease, watches pods with spec.nodeName=<node>, gives each a loopback address
(127.0.0.2, 127.0.0.3, ...) as its pod IP and hands it to a PodRuntime (pod_runtime.py). When a
pod is being deleted it stops the processes and then removes the pod object, as the kubelet does.
A small HTTPS endpoint (logs_server.py) serves container logs, so `kubectl logs` works.

Run by e2e/cluster.py; see e2e/README.md for what a local process can and cannot do.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import logs_server  # noqa: E402
import node_status  # noqa: E402
from kube_http import ApiError, KubeHTTP  # noqa: E402
from pod_runtime import PodRuntime  # noqa: E402

log = logging.getLogger("node-agent")


class PodIPs:
    """Round-robin allocator over one 127.K.0.0/16 block: a freed IP is not reused at once.

    Block K is claimed with a lock file held for the agent's lifetime, so clusters running side
    by side (several pytest sessions, a developer's cluster) never hand out the same pod IP.
    Block 0 starts at 127.0.0.2 (127.0.0.1 is the control plane and hostNetwork pods).
    """

    LOCK_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "pagefleet-e2e-podnets"

    def __init__(self):
        self.LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for block in range(0, 255):
            lock = open(self.LOCK_DIR / f"127.{block}.lock", "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            self._lock_file = lock  # kept open: the claim lasts as long as this process
            break
        else:
            raise RuntimeError(f"all 127.K.0.0/16 pod networks are claimed (see {self.LOCK_DIR})")
        self.block = block
        self.first = int(ipaddress.IPv4Address(f"127.{block}.0.{2 if block == 0 else 1}"))
        self.last = int(ipaddress.IPv4Address(f"127.{block}.255.254"))
        self.next = self.first
        self.used: set[int] = set()
        self.lock = threading.Lock()

    def take(self) -> str:
        with self.lock:
            for _ in range(self.last - self.first + 1):
                candidate, self.next = self.next, self.next + 1 if self.next < self.last else self.first
                if candidate not in self.used:
                    self.used.add(candidate)
                    return str(ipaddress.IPv4Address(candidate))
        raise RuntimeError("no free loopback pod IPs")

    def release(self, ip: str) -> None:
        with self.lock:
            self.used.discard(int(ipaddress.IPv4Address(ip)))


class NodeAgent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.node = args.node_name
        self.api = KubeHTTP(args.server, Path(args.token_file).read_text().strip(), args.ca_file)
        self.ips = PodIPs()
        self.pods: dict[str, PodRuntime] = {}  # by pod uid
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.pods_dir = Path(args.state_dir) / "pods"
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        # Pods inherit the agent's environment (PATH to our installed package), never the admin
        # kubeconfig; in-cluster clients find the apiserver through the usual service variables.
        self.base_env = {k: v for k, v in os.environ.items()
                         if k != "KUBECONFIG" and not k.startswith("PAGEFLEET_E2E")}
        # Unbuffered Python output, so container logs show up as they are written.
        self.base_env.setdefault("PYTHONUNBUFFERED", "1")
        self.base_env.update(KUBERNETES_SERVICE_HOST="127.0.0.1",
                             KUBERNETES_SERVICE_PORT=str(args.apiserver_port),
                             KUBERNETES_PORT=f"tcp://127.0.0.1:{args.apiserver_port}")

    # --- pods ------------------------------------------------------------------------------
    def handle(self, event_type: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            runtime = self.pods.get(uid)
        deleting = pod["metadata"].get("deletionTimestamp") is not None
        if event_type == "DELETED":
            if runtime:
                runtime.request_stop(min(pod["metadata"].get("deletionGracePeriodSeconds") or 2, 2))
            return
        if runtime:
            runtime.update(pod)
            return
        if deleting or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            if deleting:
                self._remove_pod(pod)  # nothing of ours runs for it (e.g. after an agent restart)
            return
        host_network = pod["spec"].get("hostNetwork", False)
        ip = "127.0.0.1" if host_network else self.ips.take()
        meta = pod["metadata"]
        pod_dir = self.pods_dir / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        runtime = PodRuntime(self.api, pod, ip, "127.0.0.1", pod_dir, self.base_env, self.args.ca_file)
        with self.lock:
            self.pods[uid] = runtime
        log.info("pod %s/%s: assigned %s", meta["namespace"], meta["name"], ip)
        runtime.start()

    def _remove_pod(self, pod: dict) -> None:
        meta = pod["metadata"]
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}}
        try:
            self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)
            log.info("pod %s/%s: removed", meta["namespace"], meta["name"])
        except ApiError as err:
            if err.status not in (404, 409):
                log.warning("pod %s/%s: delete failed: %s", meta["namespace"], meta["name"], err)

    def reap_loop(self) -> None:
        """Once a pod's processes are gone after a stop, free its IP and delete the pod object."""
        while not self.stopping.wait(0.3):
            with self.lock:
                finished = [(uid, r) for uid, r in self.pods.items() if r.stop_requested
                            and r.thread.ident is not None and not r.thread.is_alive()]
                for uid, _ in finished:
                    del self.pods[uid]
            for _, runtime in finished:
                if runtime.pod_ip != "127.0.0.1":
                    self.ips.release(runtime.pod_ip)
                self._remove_pod(runtime.pod)

    def find(self, namespace: str, name: str) -> PodRuntime | None:
        with self.lock:
            matches = [r for r in self.pods.values() if r.key == f"{namespace}/{name}"]
        return matches[-1] if matches else None

    def watch_loop(self) -> None:
        path = "/api/v1/pods"
        selector = {"fieldSelector": f"spec.nodeName={self.node}"}
        while not self.stopping.is_set():
            try:
                listing = self.api.get(path, params=selector)
                for pod in listing["items"]:
                    self.handle("ADDED", pod)
                version = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    params = dict(selector, resourceVersion=version, timeoutSeconds="300")
                    for event in self.api.watch(path, params):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", ""), "WATCH", path)
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.handle(event["type"], obj)
            except Exception as err:  # 410 Gone, connection loss: list again
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; listing again", err)
                    time.sleep(1)

    # --- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        logs_server.serve(self, self.args)  # first: it picks the port the Node advertises
        node_status.register(self.api, self.node, self.args)
        threads = [
            threading.Thread(target=node_status.heartbeat_loop, name="heartbeat",
                             args=(self.api, self.node, self.args, self.stopping), daemon=True),
            threading.Thread(target=self.watch_loop, name="watch", daemon=True),
            threading.Thread(target=self.reap_loop, name="reap", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info("node %s ready: pod IPs from %s", self.node, ipaddress.IPv4Address(self.ips.first))
        self.stopping.wait()
        self._stop_pods()

    def shutdown(self, *_):
        """SIGTERM/SIGINT: the main thread wakes up and stops the pods."""
        self.stopping.set()

    def _stop_pods(self) -> None:
        """Stop every pod's processes (grace capped at 5 s) before exiting."""
        log.info("node agent stopping: terminating %d pods", len(self.pods))
        with self.lock:
            runtimes = list(self.pods.values())
        for r in runtimes:
            r.request_stop(min(r.pod["spec"].get("terminationGracePeriodSeconds", 30), 5))
        for r in runtimes:
            r.thread.join(timeout=10)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="apiserver URL, https://127.0.0.1:PORT")
    p.add_argument("--apiserver-port", type=int, required=True)
    p.add_argument("--token-file", required=True, help="bearer token of system:node:<name>")
    p.add_argument("--ca-file", required=True)
    p.add_argument("--node-name", default="pagefleet-node")
    p.add_argument("--state-dir", required=True, help="pod working dirs, logs and pid files go here")
    p.add_argument("--capacity", action="append", default=[], metavar="RESOURCE=QUANTITY",
                   help="override node capacity, e.g. nvidia.com/gpu=4 (repeatable)")
    p.add_argument("--kubelet-port", type=int, default=0, help="HTTPS port for logs (0: any free port)")
    p.add_argument("--tls-cert", required=True)
    p.add_argument("--tls-key", required=True)
    return p.parse_args(argv)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call drowns pod events
    agent = NodeAgent(parse_args(argv))
    signal.signal(signal.SIGTERM, agent.shutdown)
    signal.signal(signal.SIGINT, agent.shutdown)
    agent.run()
    log.info("node agent stopped")


if __name__ == "__main__":
    main()
