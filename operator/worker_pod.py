"""The worker pod: its `pagefleet serve` container (flags, probes, resources) and its volumes.

The checkpoint and the LoRA adapters come from a node directory (hostPath) or a read-only claim; the
worker never downloads at start. The one writable volume is the kernel cache. Pure functions of the
InferenceService spec, as resources.py. A tensor-parallel group is one pod: its worker starts a process per GPU
and serves on one port, so the pod stays one endpoint to the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WORKER_PORT = 8000
WORKER_CONTAINER = "worker"
WORKER_COMMAND = ["pagefleet", "serve"]
DEFAULT_IMAGE = "pagefleet/pagefleet:0.1.0"
DEFAULT_DRAIN_SECONDS = 60
# The worker drains on SIGTERM with this flag's deadline (seconds).
DRAIN_FLAG = "--drain-timeout"
# Endpoint removal takes a moment to reach the gateway and kube-proxy: keep serving that long
# after the pod is marked terminating, before SIGTERM starts the drain.
PRESTOP_SLEEP_SECONDS = 5
MODEL_VOLUME = "model"
PVC_MOUNT_ROOT = "/models"
LORA_VOLUME = "lora"
LORA_MOUNT = "/adapters"
KERNEL_CACHE_VOLUME = "kernel-cache"
KERNEL_CACHE_MOUNT = "/var/cache/pagefleet"
SHM_VOLUME = "dshm"
DEFAULT_MAX_LORAS = 4
TP_FLAG = "--tensor-parallel-size"
# The ranks of a tensor-parallel group all-reduce over NVLink peer-to-peer. NVLink SHARP (multicast) needs the
# fabric manager's multicast objects inside the container and holds GPU memory per communicator: off.
TP_ENV = ({"name": "NCCL_NVLS_ENABLE", "value": "0"},)

# Engine field -> worker flag, in the order they are rendered. Booleans are handled apart.
ENGINE_VALUE_FLAGS = (
    ("gpuMemoryFraction", "--gpu-memory-fraction"),
    ("maxModelLen", "--max-model-len"),
    ("maxNumSeqs", "--max-num-seqs"),
    ("maxNumBatchedTokens", "--max-num-batched-tokens"),
    ("blockSize", "--block-size"),
    ("dtype", "--dtype"),
    ("quantization", "--quantization"),
    ("kvCacheDtype", "--kv-cache-dtype"),
)

# A big checkpoint may take many minutes to load: the startup probe allows 30 min before liveness takes over.
# Every 2 s: a start from zero holds requests at the gateway until the pod is ready, and a 10 s period
# would add up to 10 s to a worker start of ~15 s (the bundled model on CPU, e2e/test_scale_to_zero.py).
STARTUP_PROBE = {"period": 2, "failures": 900, "timeout": 5}
READINESS_PROBE = {"period": 5, "failures": 2, "timeout": 3}
LIVENESS_PROBE = {"period": 10, "failures": 6, "timeout": 5}


def model_path(model: Mapping[str, Any]) -> str:
    """Where the worker finds the checkpoint inside its container."""
    if "hostPath" in model:
        # Same path as on the node: logs, configs and the checkpoint's own references all agree.
        return model["hostPath"]["path"]
    pvc = model["pvc"]
    return f"{PVC_MOUNT_ROOT}/{pvc['claimName']}"


def source_volume(name: str, source: Mapping[str, Any]) -> dict[str, Any]:
    """The volume of a read-only source (spec.model or spec.lora): a node directory or a claim."""
    if "hostPath" in source:
        # type Directory: the kubelet refuses to start a pod whose node lacks the checkpoint,
        # instead of creating an empty directory the worker would crash on.
        return {"name": name, "hostPath": {"path": source["hostPath"]["path"], "type": "Directory"}}
    return {"name": name, "persistentVolumeClaim": {"claimName": source["pvc"]["claimName"], "readOnly": True}}


def source_mount(name: str, source: Mapping[str, Any], mount_path: str) -> dict[str, Any]:
    mount = {"name": name, "mountPath": mount_path, "readOnly": True}
    sub_path = (source.get("pvc") or {}).get("subPath")
    if sub_path:
        mount["subPath"] = sub_path
    return mount


def model_volume(model: Mapping[str, Any]) -> dict[str, Any]:
    return source_volume(MODEL_VOLUME, model)


def model_mount(model: Mapping[str, Any]) -> dict[str, Any]:
    return source_mount(MODEL_VOLUME, model, model_path(model))


def kernel_cache_volume(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Start-up compiles every kernel variant a run can need, which an empty cache pays for in seconds.
    An emptyDir outlives container restarts; a node directory (spec.kernelCache) outlives the pod."""
    host = (spec.get("kernelCache") or {}).get("hostPath")
    if host:
        return {"name": KERNEL_CACHE_VOLUME, "hostPath": {"path": host["path"], "type": "DirectoryOrCreate"}}
    return {"name": KERNEL_CACHE_VOLUME, "emptyDir": {}}


def lora_args(spec: Mapping[str, Any]) -> list[str]:
    """The worker's LoRA flags: slots for the adapters. Not the adapters themselves: the list would be part
    of the pod template, and every change to it would roll the pods. The sweep loads them (adapters.py)."""
    lora = spec.get("lora")
    if not lora:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.get("maxLoras", max(DEFAULT_MAX_LORAS, len(lora["adapters"]))))]
    if lora.get("maxLoraRank") is not None:
        args += ["--max-lora-rank", str(lora["maxLoraRank"])]
    return args


def lora_root(lora: Mapping[str, Any]) -> str:
    """Where the adapters' source is mounted: a node directory at its own path (as the model), a claim at /adapters."""
    return lora["hostPath"]["path"].rstrip("/") if "hostPath" in lora else LORA_MOUNT


def lora_adapter_names(spec: Mapping[str, Any]) -> list[str]:
    return [a["name"] for a in (spec.get("lora") or {}).get("adapters", [])]


def tensor_parallel_size(spec: Mapping[str, Any]) -> int:
    return int((spec.get("engine") or {}).get("tensorParallelSize") or 1)


def worker_args(spec: Mapping[str, Any]) -> list[str]:
    """The `pagefleet serve` flags for this spec; engine fields left unset keep the worker's defaults."""
    model = spec["model"]
    args = [
        "--model", model_path(model),
        "--served-model-name", model["name"],
        # Kubernetes expands $(POD_IP) from the container's env: the worker listens on the pod's own address.
        "--host", "$(POD_IP)",
        "--port", str(WORKER_PORT),
    ]
    engine = spec.get("engine") or {}
    for field, flag in ENGINE_VALUE_FLAGS:
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    if engine.get("enablePrefixCaching") is True:
        args.append("--enable-prefix-caching")
    elif engine.get("enablePrefixCaching") is False:
        args.append("--no-enable-prefix-caching")
    if engine.get("enforceEager"):
        args.append("--enforce-eager")
    if tensor_parallel_size(spec) > 1:
        args += [TP_FLAG, str(tensor_parallel_size(spec))]
    args += lora_args(spec)
    args += [DRAIN_FLAG, str(drain_seconds(spec))]
    args += [str(a) for a in engine.get("extraArgs") or []]
    return args


def drain_seconds(spec: Mapping[str, Any]) -> int:
    return int(spec.get("drainSeconds", DEFAULT_DRAIN_SECONDS))


def _probe(path: str, timing: Mapping[str, int]) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": timing["period"],
        "failureThreshold": timing["failures"],
        "timeoutSeconds": timing["timeout"],
    }


def container_resources(spec: Mapping[str, Any]) -> dict[str, Any]:
    wanted = spec.get("resources") or {}
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    gpus = int(wanted.get("gpus", 1))
    if gpus > 0:
        limits["nvidia.com/gpu"] = gpus
    for key in ("cpu", "memory"):
        if wanted.get(key) is not None:
            requests[key] = limits[key] = str(wanted[key])
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    return resources


def worker_container(spec: Mapping[str, Any]) -> dict[str, Any]:
    model = spec["model"]
    container = {
        "name": WORKER_CONTAINER,
        "image": spec.get("image", DEFAULT_IMAGE),
        "command": list(WORKER_COMMAND),
        "args": worker_args(spec),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Weights come from the mounted checkpoint only, never from a hub at start.
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
            {"name": "TRITON_CACHE_DIR", "value": f"{KERNEL_CACHE_MOUNT}/triton"},
        ] + ([dict(e) for e in TP_ENV] if tensor_parallel_size(spec) > 1 else []),
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "volumeMounts": [model_mount(model), {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
                         {"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_MOUNT}]
        + ([source_mount(LORA_VOLUME, spec["lora"], lora_root(spec["lora"]))] if spec.get("lora") else []),
        "startupProbe": _probe("/ready", STARTUP_PROBE),
        "readinessProbe": _probe("/ready", READINESS_PROBE),
        "livenessProbe": _probe("/health", LIVENESS_PROBE),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        # A worker that exits at start-up (a refused flag, a checkpoint it cannot read) leaves its last log
        # lines as the termination message, which status.py puts into the InferenceService's conditions.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = container_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def volumes(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pod's volumes: the checkpoint, shared memory, the kernel cache, and the adapters' source if any."""
    return [
        model_volume(spec["model"]),
        shm_volume(spec),
        kernel_cache_volume(spec),
    ] + ([source_volume(LORA_VOLUME, spec["lora"])] if spec.get("lora") else [])


def shm_volume(spec: Mapping[str, Any]) -> dict[str, Any]:
    """NCCL, tensor-parallel ranks and tokenizer workers use shared memory; the container default of 64 MiB is
    too small. Without spec.resources.sharedMemory the tmpfs has no limit of its own: it is charged to the pod's
    memory like any other page."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    limit = (spec.get("resources") or {}).get("sharedMemory")
    if limit is not None:
        empty_dir["sizeLimit"] = str(limit)
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def termination_grace_seconds(spec: Mapping[str, Any]) -> int:
    """SIGTERM comes after the preStop sleep; the worker then has drainSeconds to finish, plus a margin."""
    return PRESTOP_SLEEP_SECONDS + drain_seconds(spec) + 10
