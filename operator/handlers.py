"""kopf entry points of the InferenceService operator: reconcile children, keep status true, autoscale."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from typing import Any

import kopf

from pagefleet.operator import autoscaler, kube, resources, status

GROUP, VERSION, PLURAL = resources.GROUP, resources.VERSION, resources.PLURAL

# How often status is refreshed from the children and queue depth is probed (seconds).
STATUS_INTERVAL = float(os.environ.get("PAGEFLEET_STATUS_INTERVAL", "3"))
AUTOSCALE_INTERVAL = float(os.environ.get("PAGEFLEET_AUTOSCALE_INTERVAL", "5"))


class _QuietTimerSuccess(logging.Filter):
    """Drops kopf's 'Timer ... succeeded.' line: the status timer would log it every few seconds per object."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (record.levelno <= logging.INFO and message.startswith("Timer ") and message.endswith(" succeeded."))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    logging.getLogger("kopf.objects").addFilter(_QuietTimerSuccess())
    # One line per API call is noise even in --verbose; failures still surface as exceptions.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # Our status schema is structural: kopf's bookkeeping goes into annotations, where nothing prunes it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/operator"
    # Only warnings become Events on their own; decisions are posted explicitly with their reasons.
    settings.posting.level = logging.WARNING
    # A watch that hangs silently would stall reconciliation: renew it regularly.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    kube.shared()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, name: str, namespace: str, patch: kopf.Patch, logger: logging.Logger,
              **_: Any) -> None:
    """Applies the Deployment and Service for the current spec (server-side apply: safe to repeat)."""
    client = kube.shared()
    manifests = resources.children(body)
    for manifest in manifests:
        client.apply(manifest)
    logger.info("applied %s for generation %s",
                ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in manifests), body.metadata.get("generation"))
    patch.status["observedGeneration"] = body.metadata.get("generation")
    patch.status["selector"] = resources.selector_string(name)
    patch.status.update(_observed_status(client, body, name, namespace))


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL)
def refresh_status(body: kopf.Body, name: str, namespace: str, patch: kopf.Patch, **_: Any) -> None:
    """Keeps phase, replicas, endpoints and conditions in step with the Deployment and pods."""
    current = dict(body.get("status") or {})
    wanted = _observed_status(kube.shared(), body, name, namespace)
    wanted["selector"] = resources.selector_string(name)
    patch.status.update(status.changed_fields(current, wanted))


def _observed_status(client: kube.Kube, body: kopf.Body, name: str, namespace: str) -> dict[str, Any]:
    spec = body["spec"]
    deployment = client.get("apps/v1", "Deployment", namespace, name)
    pods = client.list("v1", "Pod", namespace, label_selector=resources.selector_string(name))
    pods = [p for p in pods if _made_by_replicaset(p)] if deployment else []
    model = spec["model"]
    claim = client.get("v1", "PersistentVolumeClaim", namespace, model["pvc"]["claimName"]) if "pvc" in model else None
    pod_names = {p["metadata"]["name"] for p in pods}
    failures = client.mount_failures(namespace, pod_names) if pod_names else {}
    source = status.check_source(model, claim, failures, pods)
    return status.compute(body, deployment, pods, source, resources.desired_replicas(spec),
                          resources.WORKER_PORT, status.now_iso())


def _made_by_replicaset(pod: dict[str, Any]) -> bool:
    # Worker pods belong to the Deployment's ReplicaSets; the selector label plus a ReplicaSet owner
    # tells them from stray pods that merely carry the label.
    return any(ref.get("kind") == "ReplicaSet" for ref in pod["metadata"].get("ownerReferences") or [])


def _autoscaling_on(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("autoscaling"))


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE_INTERVAL, when=_autoscaling_on)
async def autoscale(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, patch: kopf.Patch,
                    logger: logging.Logger, **_: Any) -> None:
    """Probes each ready pod's /load and sets spec.replicas to keep the average queue near the target."""
    client = kube.shared()
    pods = await asyncio.to_thread(client.list, "v1", "Pod", namespace,
                                   label_selector=resources.selector_string(name))
    urls = status.endpoints(pods, resources.WORKER_PORT)
    waiting = await autoscaler.probe_waiting(urls)
    settings = spec["autoscaling"]
    previous = dict((body.get("status") or {}).get("autoscaling") or {})
    decision = autoscaler.decide(
        current=int(spec.get("replicas", 1)),
        waiting=list(waiting.values()),
        target=float(settings.get("targetQueueDepth", 4)),
        min_replicas=int(settings.get("minReplicas", 1)),
        max_replicas=int(settings["maxReplicas"]),
        scale_down_delay=float(settings.get("scaleDownDelaySeconds", 300)),
        now=time.time(),
        low_since=_epoch(previous.get("lowLoadSince")),
    )
    report = {
        "averageQueueDepth": round(decision.average, 3) if decision.average is not None else None,
        "desiredReplicas": decision.replicas,
        "lowLoadSince": _iso(decision.low_since),
        "lastDecision": f"{decision.reason}: {decision.message}",
    }
    if decision.changed:
        await asyncio.to_thread(client.scale, namespace, name, decision.replicas)
        patch.status["lastScaleTime"] = status.now_iso()
        logger.info("autoscaler %s: %s", decision.reason, decision.message)
        kopf.event(body, type="Normal", reason=decision.reason, message=decision.message)
    elif decision.reason != previous.get("lastDecision", "").split(":", 1)[0]:
        logger.info("autoscaler %s: %s", decision.reason, decision.message)
    # Only the decision's reason is compared: a changing average alone is not worth a status write.
    if decision.changed or any(previous.get(k) != report[k] for k in ("desiredReplicas", "lowLoadSince")) \
            or not previous.get("lastDecision", "").startswith(decision.reason + ":"):
        patch.status["autoscaling"] = report


def _epoch(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return status.now_iso(datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc))
