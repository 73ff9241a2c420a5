"""Render an InferenceService into the manifests of its children: the worker Deployment and its Service.

Pure functions of the custom object (a plain dict as the API server returns it, defaults filled in),
so that what the operator applies can be tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagefleet.operator import scale_to_zero
from pagefleet.operator.worker_pod import (
    WORKER_PORT,
    lora_adapter_names,
    termination_grace_seconds,
    volumes,
    worker_container,
)

GROUP = "pagefleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

# The selector label: every child and every worker pod carries it.
INSTANCE_LABEL = f"{GROUP}/inference-service"
SERVED_MODEL_ANNOTATION = f"{GROUP}/served-model-name"
# The adapters' names, comma-separated: the gateway routes them to the same workers as the model.
LORA_ADAPTERS_ANNOTATION = f"{GROUP}/lora-adapters"
# "true" when spec.autoscaling allows 0 replicas: the gateway then holds a request for the model while it has
# no worker and scales the InferenceService to 1 (gateway/cold_start.py).
SCALE_TO_ZERO_ANNOTATION = f"{GROUP}/scale-to-zero"
FIELD_MANAGER = "pagefleet-operator"


def labels(name: str) -> dict[str, str]:
    """Labels of every child and worker pod of the InferenceService `name`."""
    return {
        "app.kubernetes.io/name": "pagefleet-worker",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        INSTANCE_LABEL: name,
    }


def selector(name: str) -> dict[str, str]:
    return {INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """The pod selector as the scale subresource wants it (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """Makes the InferenceService the controlling owner: deleting it garbage-collects the child."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def desired_replicas(spec: Mapping[str, Any]) -> int:
    """spec.replicas, kept inside [minReplicas, maxReplicas] while autoscaling is on."""
    replicas = int(spec.get("replicas", 1))
    autoscaling = spec.get("autoscaling")
    if autoscaling:
        low = int(autoscaling.get("minReplicas", 1))
        high = int(autoscaling["maxReplicas"])
        replicas = max(low, min(high, replicas))
    return replicas


def deployment(body: Mapping[str, Any]) -> dict[str, Any]:
    """The worker Deployment: `pagefleet serve` pods with the model mounted read-only."""
    meta = body["metadata"]
    name, spec = meta["name"], body["spec"]
    pod_spec: dict[str, Any] = {
        "containers": [worker_container(spec)],
        "volumes": volumes(spec),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "enableServiceLinks": False,
    }
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in spec["tolerations"]]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels(name),
            "annotations": {SERVED_MODEL_ANNOTATION: spec["model"]["name"]},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "replicas": desired_replicas(spec),
            "selector": {"matchLabels": selector(name)},
            # One extra pod at a time and never fewer ready than desired: serving capacity holds during a roll.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels(name),
                    "annotations": {SERVED_MODEL_ANNOTATION: spec["model"]["name"]},
                },
                "spec": pod_spec,
            },
        },
    }


def service(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Service in front of the ready workers; its EndpointSlices (which copy its labels) list them for the
    gateway."""
    meta = body["metadata"]
    name = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": labels(name),
            "annotations": service_annotations(body["spec"]),
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def service_annotations(spec: Mapping[str, Any]) -> dict[str, str]:
    """What the gateway reads: the model group, and the adapters served in the same workers."""
    annotations = {SERVED_MODEL_ANNOTATION: spec["model"]["name"]}
    if lora_adapter_names(spec):
        annotations[LORA_ADAPTERS_ANNOTATION] = ",".join(lora_adapter_names(spec))
    if scale_to_zero.enabled(spec):
        annotations[SCALE_TO_ZERO_ANNOTATION] = "true"
    return annotations


def children(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Everything the operator applies for one InferenceService, in apply order."""
    return [service(body), deployment(body)]
