"""kopf entry points of the InferenceService operator: settings, reconcile, the index and the periodic sweep."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import httpx
import kopf

from pagefleet.operator import kube, resources, scale_to_zero, sweep

GROUP, VERSION, PLURAL = resources.GROUP, resources.VERSION, resources.PLURAL

# How often status is refreshed from the children and queue depth is probed (seconds).
STATUS_INTERVAL = float(os.environ.get("PAGEFLEET_STATUS_INTERVAL", "3"))
AUTOSCALE_INTERVAL = float(os.environ.get("PAGEFLEET_AUTOSCALE_INTERVAL", "5"))


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, inference_services: kopf.Index,
                **_: Any) -> None:
    # One line per API call is noise even in --verbose; failures still surface as exceptions.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # Our status schema is structural: kopf's bookkeeping goes into annotations, where nothing prunes it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/operator"
    # Only warnings become Events on their own; scaling decisions are posted with their reasons.
    settings.posting.level = logging.WARNING
    # A watch that hangs silently would stall reconciliation: renew it regularly.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    client = await asyncio.to_thread(kube.shared)
    sweeper = sweep.Sweeper(client, STATUS_INTERVAL, AUTOSCALE_INTERVAL)
    # The index follows every InferenceService the operator serves; the sweep reads it on each pass.
    memo.sweep_task = asyncio.create_task(
        sweeper.run_forever(lambda: [body for store in inference_services.values() for body in store]),
        name="pagefleet status and autoscaling sweep")


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("sweep_task")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@kopf.index(GROUP, VERSION, PLURAL)
def inference_services(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict:
    """(namespace, name) -> a snapshot of the object, for the sweep."""
    snapshot = {key: _plain(value) for key, value in body.items()}
    return {(namespace, name): snapshot}


def _plain(value: Any) -> Any:
    """A deep copy made of dicts and lists: the index must not hold views of a body that kopf replaces."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    """Applies the Deployment and Service for the current spec (server-side apply: safe to repeat)."""
    client = kube.shared()
    manifests = resources.children(body)
    for manifest in manifests:
        try:
            client.apply(manifest)
        except kube.ApiError as err:
            what = f"applying {manifest['kind']}/{manifest['metadata']['name']}: {err}"
            if err.status in (400, 422):
                # The API server refuses the rendered object: retrying the same spec cannot help.
                raise kopf.PermanentError(what) from err
            # Conflicts, throttling, RBAC being fixed, the API server restarting: try again later.
            raise kopf.TemporaryError(what, delay=15) from err
    logger.info("applied %s for generation %s",
                ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in manifests), body.metadata.get("generation"))
    patch.status["observedGeneration"] = body.metadata.get("generation")
    try:
        observed = sweep.observed_status(client, _plain(body))
        patch.status.update(observed)
        sweep.report_worker_exit(client, _plain(body), observed)
    except (kube.ApiError, httpx.HTTPError) as err:
        # The children are applied; a failed read of them must not hold this handler in kopf's retry
        # backoff (60 s), which would delay the next spec change. The sweep refreshes status within seconds.
        logger.warning("status after applying generation %s: %s", body.metadata.get("generation"), err)


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.replicas")
def scaled_from_zero(old: Any, new: Any, body: kopf.Body, **_: Any) -> None:
    """An Event when a service that scales to zero leaves 0 replicas (the gateway asks for 1 when a request
    for it is held; `kubectl scale` works too); the ScaledToZero Event is the sweep's."""
    if old == 0 and new and scale_to_zero.enabled(body.spec):
        message = f"spec.replicas 0 -> {new} while idle: starting a worker"
        kube.shared().post_event(_plain(body), "Normal", scale_to_zero.SCALED_FROM_ZERO, message)
