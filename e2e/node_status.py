"""The node agent's Node object: registration, status heartbeats and the node Lease.

The node lifecycle controller marks a node NotReady (and taints it) when neither its Lease is
renewed nor its status posted for --node-monitor-grace-period; the kubelet renews the Lease every
10 s and posts status at least every few minutes, and so do we.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import threading

from kube_http import ApiError, KubeHTTP

log = logging.getLogger("node-agent")

LEASE_SECONDS = 40
RENEW_EVERY = 10
STATUS_EVERY = 60
KUBE_VERSION = "v1.34.4"

# Capacity is what the scheduler fits pods into; processes are not limited by it. GPUs are
# advertised so GPU-requesting pods (our workers) schedule on a machine without them.
DEFAULT_CAPACITY = {
    "cpu": "32",
    "memory": "256Gi",
    "ephemeral-storage": "200Gi",
    "pods": "110",
    "nvidia.com/gpu": "8",
}


def _now(micro: bool = False) -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _capacity(overrides: list[str]) -> dict[str, str]:
    capacity = dict(DEFAULT_CAPACITY)
    for item in overrides:
        name, _, quantity = item.partition("=")
        capacity[name] = quantity
    return capacity


_REGISTERED_AT = _now()


def _status(args) -> dict:
    now = _now()
    conditions = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID"),
        ("Ready", "True", "KubeletReady"),
    ]
    capacity = _capacity(args.capacity)
    return {
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": [
            {"type": t, "status": s, "reason": r, "message": "pagefleet e2e node agent",
             "lastHeartbeatTime": now, "lastTransitionTime": _REGISTERED_AT}
            for t, s, r in conditions
        ],
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": args.node_name},
        ],
        # Where the apiserver sends `kubectl logs` (logs_server.py).
        "daemonEndpoints": {"kubeletEndpoint": {"Port": args.kubelet_port}},
        "nodeInfo": {
            "machineID": "", "systemUUID": "", "bootID": "",
            "kernelVersion": platform.release(), "osImage": "pagefleet e2e node agent",
            "containerRuntimeVersion": "pagefleet-local-process://0",
            "kubeletVersion": KUBE_VERSION, "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64",
        },
    }


def register(api: KubeHTTP, node: str, args) -> None:
    """Create the Node (or take over an existing one) and post a Ready status."""
    labels = {
        "kubernetes.io/hostname": node,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "nvidia.com/gpu.present": "true",
    }
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}, "spec": {}}
    try:
        api.create("/api/v1/nodes", body)
        log.info("registered node %s (pid %d)", node, os.getpid())
    except ApiError as err:
        if err.status != 409:
            raise
        log.info("node %s exists; taking it over", node)
    api.merge_patch(f"/api/v1/nodes/{node}/status", {"status": _status(args)})
    renew_lease(api, node)


def renew_lease(api: KubeHTTP, node: str) -> None:
    path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _now(micro=True)}
    try:
        api.merge_patch(path, {"spec": spec})
    except ApiError as err:
        if err.status != 404:
            raise
        node_uid = api.get(f"/api/v1/nodes/{node}")["metadata"]["uid"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
        api.create(path.rsplit("/", 1)[0], {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": node, "namespace": "kube-node-lease", "ownerReferences": [owner]},
            "spec": spec,
        })


def heartbeat_loop(api: KubeHTTP, node: str, args, stopping: threading.Event) -> None:
    ticks = 0
    while not stopping.wait(RENEW_EVERY):
        ticks += 1
        try:
            renew_lease(api, node)
            if ticks % (STATUS_EVERY // RENEW_EVERY) == 0:
                api.merge_patch(f"/api/v1/nodes/{node}/status", {"status": _status(args)})
        except Exception as err:  # the apiserver may be restarting; try again next tick
            log.warning("heartbeat: %s", err)
