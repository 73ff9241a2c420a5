"""Which workers serve which model: a static list, or the EndpointSlices of InferenceService Services.

`Fleet` keeps LiteLLM's router and our prober in step: a worker joins both or neither.
`watch_endpointslices` follows the operator's contract (operator/resources.py): each
InferenceService has a Service labelled `pagefleet.io/inference-service=<name>`, annotated with
`pagefleet.io/served-model-name`, whose port is named `http`. The EndpointSlice controller copies
the Service's labels onto its slices, so one watch on that label sees every worker of every
InferenceService in the namespace; the Service annotation gives the model group, and
`pagefleet.io/lora-adapters` (comma-separated) the LoRA adapters the same workers serve, each its own group.
The Services are watched too: the operator edits that annotation when spec.lora changes, with no pod
restarting, so no slice would change to tell us. A Service annotated `pagefleet.io/scale-to-zero` keeps
its model groups while it has no ready worker: their requests wait in gateway/cold_start.py while
`scale_from_zero` asks its InferenceService for one replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from litellm.types.router import Deployment

from pagefleet.gateway.config import deployment, deployment_id
from pagefleet.gateway.probe import Prober

log = logging.getLogger("pagefleet.gateway.membership")

INSTANCE_LABEL = "pagefleet.io/inference-service"
SERVED_MODEL_ANNOTATION = "pagefleet.io/served-model-name"
LORA_ADAPTERS_ANNOTATION = "pagefleet.io/lora-adapters"
SCALE_TO_ZERO_ANNOTATION = "pagefleet.io/scale-to-zero"
INFERENCE_SERVICES = ("pagefleet.io", "v1alpha1", "inferenceservices")
FIELD_MANAGER = "pagefleet-gateway"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"


class Fleet:
    """The current set of (served model name, worker URL), mirrored into the router and the prober."""

    def __init__(self, router, prober: Prober, worker_api_key: str | None = None, cold_starts=None):
        self.router = router
        self.prober = prober
        self.worker_api_key = worker_api_key
        self.cold_starts = cold_starts  # a cold_start.ColdStarts, told which groups have workers after each sync
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

    def sync(self, wanted: set[tuple[str, str]], wakeable: dict[str, str] | None = None) -> None:
        """Makes the members exactly `wanted`: removals first, so a moved address never serves twice.
        `wakeable`: model group -> InferenceService, for the groups that scale to zero. Held requests of a
        group go on only after its worker is in the router."""
        for model_name, url in sorted(self.members - wanted):
            self.remove(model_name, url)
        for model_name, url in sorted(wanted - self.members):
            self.add(model_name, url)
        if self.cold_starts is not None:
            self.cold_starts.update(wakeable, {model_name for model_name, _ in self.members})


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


def scale_from_zero(api, namespace: str, name: str) -> bool:
    """Sets the InferenceService `name` to 1 replica if it has 0, through its scale subresource (the
    operator does the rest); True if this call did it. Read and write carry the resourceVersion, so a
    scale-up by the autoscaler or a person in between is never undone (409: read again)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    custom = client.CustomObjectsApi(api)
    for _ in range(3):
        scale = custom.get_namespaced_custom_object_scale(*INFERENCE_SERVICES[:2], namespace,
                                                          INFERENCE_SERVICES[2], name)
        if int((scale.get("spec") or {}).get("replicas") or 0) > 0:
            return False
        scale["spec"] = {"replicas": 1}
        try:
            custom.replace_namespaced_custom_object_scale(*INFERENCE_SERVICES[:2], namespace, INFERENCE_SERVICES[2],
                                                          name, scale, field_manager=FIELD_MANAGER)
        except ApiException as exc:
            if exc.status == 409:
                continue
            raise
        log.info("scaled %s/%s from zero to 1 replica for held requests", namespace, name)
        return True
    return False


@dataclass(frozen=True)
class ServiceView:
    """What the gateway reads from one InferenceService's Service."""

    groups: tuple[str, ...]  # model groups its workers serve
    scale_to_zero: bool  # keep the groups, and wake the service, while it has no worker

    @classmethod
    def of(cls, service: dict) -> ServiceView:
        annotations = service["metadata"].get("annotations") or {}
        return cls(tuple(model_groups(annotations, service["metadata"]["name"])),
                   annotations.get(SCALE_TO_ZERO_ANNOTATION) == "true")


def kubernetes_client():
    """In a pod, its service account; elsewhere $KUBECONFIG or ~/.kube/config. A clear error if neither."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise SystemExit(f"pagefleet gateway --kubernetes: no in-cluster config and no kubeconfig ({exc})") from exc
    return client.ApiClient()


class _Watches:
    """Two watches, one view: the EndpointSlices (which pods are ready) and the Services (which model
    groups their pods serve: the model, then the LoRA adapters, which the operator swaps in running pods).
    Each runs on its own thread (the kubernetes client is synchronous); every event publishes the whole
    set of (model group, worker URL)."""

    def __init__(self, api, namespace: str, on_change: Callable[[set[tuple[str, str]], dict[str, str]], None],
                 stop: threading.Event):
        from kubernetes import client

        self.api, self.namespace, self.on_change, self.stop = api, namespace, on_change, stop
        self.discovery, self.core = client.DiscoveryV1Api(api), client.CoreV1Api(api)
        self.lock = threading.Lock()
        self.slices: dict[str, dict] = {}  # slice name -> slice as a plain dict
        self.services: dict[str, ServiceView] = {}

    def publish(self) -> None:
        with self.lock:
            wanted = set()
            for s in self.slices.values():
                service = (s.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL)
                view = self.services.get(service) if service else None
                for model in view.groups if view else ():
                    wanted |= ready_workers(s, model)
            wakeable = {group: name for name, view in self.services.items() if view.scale_to_zero
                        for group in view.groups}
        self.on_change(wanted, wakeable)

    def watch_slices(self) -> None:
        self._watch("EndpointSlice", self.discovery.list_namespaced_endpoint_slice, "slices", lambda obj: obj)

    def watch_services(self) -> None:
        self._watch("Service", self.core.list_namespaced_service, "services", ServiceView.of)

    def _watch(self, kind: str, list_fn, table: str, entry: Callable[[dict], object]) -> None:
        """List, then watch from that list's version; list again when the API server ends the watch or
        the version expires. A fresh list replaces its table in one step: the other thread never
        publishes from a half-filled one."""
        from kubernetes import watch

        while not self.stop.is_set():
            try:
                listed = list_fn(self.namespace, label_selector=INSTANCE_LABEL)
                fresh = {}
                for o in listed.items:
                    obj = self.api.sanitize_for_serialization(o)
                    fresh[obj["metadata"]["name"]] = entry(obj)
                with self.lock:
                    setattr(self, table, fresh)
                self.publish()
                w = watch.Watch()
                for event in w.stream(list_fn, self.namespace, label_selector=INSTANCE_LABEL,
                                      resource_version=listed.metadata.resource_version, timeout_seconds=30):
                    obj = self.api.sanitize_for_serialization(event["object"])
                    with self.lock:
                        if event["type"] == "DELETED":
                            getattr(self, table).pop(obj["metadata"]["name"], None)
                        else:
                            getattr(self, table)[obj["metadata"]["name"]] = entry(obj)
                    self.publish()
                    if self.stop.is_set():
                        w.stop()
                        break
            except Exception as exc:  # expired resourceVersion, API server restart: list again
                if self.stop.is_set():
                    break
                log.warning("%s watch interrupted (%s); listing again", kind, exc)
                self.stop.wait(1.0)


def start_kubernetes_membership(fleet: Fleet, namespace: str) -> threading.Event:
    """Runs the watch on a daemon thread; every change is applied on the event loop's thread."""
    api = kubernetes_client()
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def on_change(wanted: set[tuple[str, str]], wakeable: dict[str, str]) -> None:
        loop.call_soon_threadsafe(fleet.sync, wanted, wakeable)

    if fleet.cold_starts is not None:
        async def wake(name: str) -> None:
            await asyncio.to_thread(scale_from_zero, api, namespace, name)

        fleet.cold_starts.wake = wake
    watches = _Watches(api, namespace, on_change, stop)
    threading.Thread(target=watches.watch_services, name="pagefleet-service-watch", daemon=True).start()
    threading.Thread(target=watches.watch_slices, name="pagefleet-endpointslice-watch", daemon=True).start()
    return stop
