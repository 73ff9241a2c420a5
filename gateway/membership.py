"""Which workers serve which model: a static list, or the EndpointSlices of InferenceService Services.

`Fleet` keeps LiteLLM's router and our prober in step: a worker joins both or neither.
`watch_endpointslices` follows the operator's contract (operator/resources.py): each
InferenceService has a Service labelled `pagefleet.io/inference-service=<name>`, annotated with
`pagefleet.io/served-model-name`, whose port is named `http`. The EndpointSlice controller copies
the Service's labels onto its slices, so one watch on that label sees every worker of every
InferenceService in the namespace; the Service annotation gives the model group, and
`pagefleet.io/lora-adapters` (comma-separated) the LoRA adapters the same workers serve, each its own group.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from litellm.types.router import Deployment

from pagefleet.gateway.config import deployment, deployment_id
from pagefleet.gateway.probe import Prober

log = logging.getLogger("pagefleet.gateway.membership")

INSTANCE_LABEL = "pagefleet.io/inference-service"
SERVED_MODEL_ANNOTATION = "pagefleet.io/served-model-name"
LORA_ADAPTERS_ANNOTATION = "pagefleet.io/lora-adapters"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"


class Fleet:
    """The current set of (served model name, worker URL), mirrored into the router and the prober."""

    def __init__(self, router, prober: Prober, worker_api_key: str | None = None):
        self.router = router
        self.prober = prober
        self.worker_api_key = worker_api_key
        self.members: set[tuple[str, str]] = set()

    def add(self, model_name: str, url: str) -> None:
        if (model_name, url) in self.members:
            return
        entry = deployment(model_name, url, self.worker_api_key)
        self.router.add_deployment(Deployment(**entry))
        self.members.add((model_name, url))
        self.prober.add(url)
        log.info("worker joined: %s serving %s", url, model_name)

    def remove(self, model_name: str, url: str) -> None:
        if (model_name, url) not in self.members:
            return
        self.router.delete_deployment(id=deployment_id(model_name, url))
        self.members.discard((model_name, url))
        if not any(u == url for _, u in self.members):
            self.prober.remove(url)
        log.info("worker left: %s serving %s", url, model_name)

    def sync(self, wanted: set[tuple[str, str]]) -> None:
        """Makes the members exactly `wanted`: removals first, so a moved address never serves twice."""
        for model_name, url in sorted(self.members - wanted):
            self.remove(model_name, url)
        for model_name, url in sorted(wanted - self.members):
            self.add(model_name, url)


def ready_workers(slice_obj: dict, served_model_name: str) -> set[tuple[str, str]]:
    """(model, http://ip:port) for each ready endpoint of one EndpointSlice (a plain dict from the API)."""
    ports = [p for p in slice_obj.get("ports") or [] if p.get("name") in (PORT_NAME, None, "")]
    if not ports or ports[0].get("port") is None:
        return set()
    port = ports[0]["port"]
    family = slice_obj.get("addressType", "IPv4")
    out = set()
    for ep in slice_obj.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        # ready is unset means ready (the API's own convention); a terminating pod is not ready.
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        for address in ep.get("addresses") or []:
            host = f"[{address}]" if family == "IPv6" else address
            out.add((served_model_name, f"http://{host}:{port}"))
    return out


def model_groups(annotations: dict, service: str) -> list[str]:
    """The model groups a Service's workers serve: its model, then its LoRA adapters.

    No model annotation: the Service name is the model group (a hand-made Service still works)."""
    adapters = [a.strip() for a in (annotations.get(LORA_ADAPTERS_ANNOTATION) or "").split(",") if a.strip()]
    return [annotations.get(SERVED_MODEL_ANNOTATION) or service] + adapters


def kubernetes_client():
    """In a pod, its service account; elsewhere $KUBECONFIG or ~/.kube/config. A clear error if neither."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise SystemExit(f"pagefleet gateway --kubernetes: no in-cluster config and no kubeconfig ({exc})")
    return client.ApiClient()


def watch_endpointslices(api, namespace: str, on_change: Callable[[set[tuple[str, str]]], None],
                         stop: threading.Event) -> None:
    """Blocking: lists and watches the slices, calling `on_change(all ready workers)` after each event.

    Runs on its own thread (the kubernetes client is synchronous); restarts the watch when the
    API server closes it or the resourceVersion expires.
    """
    from kubernetes import client, watch

    discovery, core = client.DiscoveryV1Api(api), client.CoreV1Api(api)
    selector = INSTANCE_LABEL
    slices: dict[str, dict] = {}  # slice name -> slice as a plain dict
    models_of_service: dict[str, list[str]] = {}

    def served_models(service: str) -> list[str]:
        if service not in models_of_service:
            try:
                svc = core.read_namespaced_service(service, namespace)
            except client.ApiException as exc:
                log.warning("cannot read Service %s/%s: %s", namespace, service, exc.reason)
                return []
            models_of_service[service] = model_groups(svc.metadata.annotations or {}, service)
        return models_of_service[service]

    def publish() -> None:
        wanted = set()
        for s in slices.values():
            service = (s.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL)
            for model in served_models(service) if service else []:
                wanted |= ready_workers(s, model)
        on_change(wanted)

    while not stop.is_set():
        try:
            listed = discovery.list_namespaced_endpoint_slice(namespace, label_selector=selector)
            slices = {s.metadata.name: api.sanitize_for_serialization(s) for s in listed.items}
            models_of_service.clear()  # annotations (the adapters) may have changed meanwhile
            publish()
            w = watch.Watch()
            for event in w.stream(discovery.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                                  resource_version=listed.metadata.resource_version, timeout_seconds=30):
                obj = api.sanitize_for_serialization(event["object"])
                name = obj["metadata"]["name"]
                if event["type"] == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = obj
                publish()
                if stop.is_set():
                    w.stop()
                    break
        except Exception as exc:  # expired resourceVersion, API server restart: list again
            if stop.is_set():
                break
            log.warning("EndpointSlice watch interrupted (%s); listing again", exc)
            stop.wait(1.0)


def start_kubernetes_membership(fleet: Fleet, namespace: str) -> threading.Event:
    """Runs the watch on a daemon thread; every change is applied on the event loop's thread."""
    api = kubernetes_client()
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def on_change(wanted: set[tuple[str, str]]) -> None:
        loop.call_soon_threadsafe(fleet.sync, wanted)

    threading.Thread(target=watch_endpointslices, args=(api, namespace, on_change, stop),
                     name="pagefleet-endpointslice-watch", daemon=True).start()
    return stop
