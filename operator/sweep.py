"""The operator's periodic pass over every InferenceService: status from its children, LoRA adapters into the
ready workers, replicas from queue depth.

One loop for the whole operator (not a kopf timer per object): timers would put a finalizer on every
InferenceService, and an operator that is down or uninstalled would then block their deletion. Here
nothing needs to run when an InferenceService goes: its children go by garbage collection.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pagefleet.operator import adapters, autoscaler, kube, resources, scale_to_zero, status, worker_pod

log = logging.getLogger("pagefleet.operator")


def observed_status(client: kube.Kube, body: Mapping[str, Any]) -> dict[str, Any]:
    """The status fields the Deployment, the pods, the claim and their events call for now."""
    meta, spec = body["metadata"], body["spec"]
    name, namespace = meta["name"], meta["namespace"]
    deployment = client.get("apps/v1", "Deployment", namespace, name)
    pods = client.list("v1", "Pod", namespace, label_selector=resources.selector_string(name))
    # Worker pods belong to the Deployment's ReplicaSets; the label alone could match a stray pod.
    pods = [p for p in pods if _made_by_replicaset(p)] if deployment else []
    model = spec["model"]
    claim = client.get("v1", "PersistentVolumeClaim", namespace, model["pvc"]["claimName"]) if "pvc" in model else None
    pod_names = {p["metadata"]["name"] for p in pods}
    failures = client.mount_failures(namespace, pod_names) if pod_names else {}
    source = status.check_source(model, claim, failures, pods)
    observed = status.compute(body, deployment, pods, source, resources.desired_replicas(spec),
                              worker_pod.WORKER_PORT, status.now_iso())
    observed["selector"] = resources.selector_string(name)
    return observed


def _made_by_replicaset(pod: Mapping[str, Any]) -> bool:
    return any(ref.get("kind") == "ReplicaSet" for ref in pod["metadata"].get("ownerReferences") or [])


def report_worker_exit(client: kube.Kube, body: Mapping[str, Any], observed: Mapping[str, Any]) -> None:
    """A Warning Event when the Degraded condition turns True, after its status is written: `kubectl describe`
    lists it under the conditions, with the error the worker exited with."""
    message = status.start_failure_event(body.get("status") or {}, observed)
    if message:
        log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
        client.post_event(body, "Warning", status.WORKER_EXITED, message)


class Sweeper:
    """Every `status_interval` seconds: refresh each InferenceService's status and bring its workers'
    LoRA adapters in line with spec.lora; every `autoscale_interval`, probe the queues of those with
    spec.autoscaling and set their replicas."""

    def __init__(self, client: kube.Kube, status_interval: float, autoscale_interval: float):
        self.client = client
        self.status_interval = status_interval
        self.autoscale_interval = autoscale_interval
        self.last_autoscale: dict[str, float] = {}  # uid -> monotonic time of its last autoscaling pass
        self.steps_seen: dict[str, dict[str, int]] = {}  # uid -> worker URL -> engine steps at the last idle probe

    async def run_forever(self, bodies: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        while True:
            started = time.monotonic()
            await self.sweep(list(bodies()))
            await asyncio.sleep(max(0.0, self.status_interval - (time.monotonic() - started)))

    async def sweep(self, bodies: list[Mapping[str, Any]]) -> None:
        live = {b["metadata"]["uid"] for b in bodies}
        for uid in set(self.last_autoscale) - live:
            del self.last_autoscale[uid]
            self.steps_seen.pop(uid, None)
        for body in bodies:
            if body["metadata"].get("deletionTimestamp"):
                continue
            try:
                await asyncio.to_thread(self.refresh_status, body)
                if body["spec"].get("lora"):
                    await self.sync_lora(body)
                if body["spec"].get("autoscaling") and self._autoscale_due(body["metadata"]["uid"]):
                    await self.autoscale(body)
            except kube.ApiError as err:
                if err.status != 404:  # 404: deleted since the index saw it
                    log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], err)
            except Exception:  # one broken object must not stop the others' upkeep
                log.exception("%s/%s: status/autoscaling pass failed",
                              body["metadata"]["namespace"], body["metadata"]["name"])

    def _autoscale_due(self, uid: str) -> bool:
        now = time.monotonic()
        if now - self.last_autoscale.get(uid, float("-inf")) < self.autoscale_interval:
            return False
        self.last_autoscale[uid] = now
        return True

    def refresh_status(self, body: Mapping[str, Any]) -> None:
        """Patches the status fields that differ from what the children show."""
        observed = observed_status(self.client, body)
        changes = status.changed_fields(body.get("status") or {}, observed)
        if changes:
            meta = body["metadata"]
            self.client.patch_status(meta["namespace"], meta["name"], changes)
            report_worker_exit(self.client, body, observed)

    async def ready_workers(self, namespace: str, name: str) -> list[str]:
        """URLs of the InferenceService's ready worker pods, read now."""
        pods = await asyncio.to_thread(self.client.list, "v1", "Pod", namespace,
                                       label_selector=resources.selector_string(name))
        return status.endpoints(pods, worker_pod.WORKER_PORT)

    async def sync_lora(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Loads and unloads adapters in each ready worker to match spec.lora; reports status.lora."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        desired = adapters.desired_adapters(body["spec"])
        results = await adapters.sync_workers(await self.ready_workers(namespace, name), desired)
        report = adapters.status_of(desired, results)
        if (body.get("status") or {}).get("lora") != report:  # written (and logged) only when it changes
            if report["message"]:
                log.warning("%s/%s LoRA adapters: %s", namespace, name, report["message"])
            await asyncio.to_thread(self.client.patch_status, namespace, name, {"lora": report})
        return report

    async def autoscale(self, body: Mapping[str, Any]) -> autoscaler.Decision:
        """Probes each ready pod's /load and sets spec.replicas to keep the average queue near the target;
        with scale to zero, also goes to 0 replicas once no request has run for scaleToZeroAfterSeconds."""
        meta, spec = body["metadata"], body["spec"]
        name, namespace = meta["name"], meta["namespace"]
        settings = spec["autoscaling"]
        previous = dict((body.get("status") or {}).get("autoscaling") or {})
        current = int(spec.get("replicas", 1))
        to_zero = scale_to_zero.enabled(spec)
        idle_since = None
        if to_zero and current == 0:
            # Nothing runs to probe; waking is the gateway's (it sets spec.replicas through the scale subresource).
            self.steps_seen.pop(meta["uid"], None)
            decision = autoscaler.Decision(0, 0, None, 0, None, scale_to_zero.AT_ZERO,
                                           "0 replicas; the gateway scales to 1 on the next request for the model")
        else:
            urls = await self.ready_workers(namespace, name)
            waiting = await autoscaler.probe_waiting(urls)
            decision = autoscaler.decide(
                current=current,
                waiting=list(waiting.values()),
                target=float(settings.get("targetQueueDepth", 4)),
                # Load alone never empties the service: going to zero is the idle decision's.
                min_replicas=max(1, int(settings.get("minReplicas", 1))),
                max_replicas=int(settings["maxReplicas"]),
                scale_down_delay=float(settings.get("scaleDownDelaySeconds", 300)),
                now=time.time(),
                low_since=status.epoch(previous.get("lowLoadSince")),
            )
            if to_zero:
                decision, idle_since = await self.idle(body, decision, urls, status.epoch(previous.get("idleSince")))
        report: dict[str, Any] = {
            "averageQueueDepth": round(decision.average, 3) if decision.average is not None else None,
            "desiredReplicas": decision.replicas,
            "lowLoadSince": _iso(decision.low_since),
            "lastDecision": f"{decision.reason}: {decision.message}",
        }
        if to_zero:
            report["idleSince"] = _iso(idle_since)
        same_decision = previous.get("lastDecision", "").startswith(decision.reason + ":")
        if decision.changed:
            await asyncio.to_thread(self.client.scale, namespace, name, decision.replicas)
            log.info("%s/%s autoscaler %s: %s", namespace, name, decision.reason, decision.message)
            await asyncio.to_thread(self.client.post_event, body, "Normal", decision.reason, decision.message)
            await asyncio.to_thread(self.client.patch_status, namespace, name,
                                    {"autoscaling": report, "lastScaleTime": status.now_iso()})
        elif not same_decision or any(previous.get(k) != report.get(k)
                                      for k in ("desiredReplicas", "lowLoadSince", "idleSince")):
            # A changing average alone is not worth a write every few seconds.
            if not same_decision:
                log.info("%s/%s autoscaler %s: %s", namespace, name, decision.reason, decision.message)
            await asyncio.to_thread(self.client.patch_status, namespace, name, {"autoscaling": report})
        return decision

    async def idle(self, body: Mapping[str, Any], decision: autoscaler.Decision, urls: list[str],
                   idle_since: float | None) -> tuple[autoscaler.Decision, float | None]:
        """The idle step after the load's: reads the workers' step counters and, past scaleToZeroAfterSeconds
        without a request, turns the decision into 0 replicas. Returns the decision and the idle start."""
        uid = body["metadata"]["uid"]
        samples = await scale_to_zero.probe(urls)
        active = scale_to_zero.activity(samples, self.steps_seen.get(uid, {}))
        self.steps_seen[uid] = {url: s.steps for url, s in samples.items()}
        idle = scale_to_zero.decide(current=decision.current, active=active, now=time.time(), idle_since=idle_since,
                                    after=float(body["spec"]["autoscaling"]["scaleToZeroAfterSeconds"]))
        if decision.changed or idle.reason in (scale_to_zero.ACTIVE, scale_to_zero.NO_SAMPLE):
            return decision, idle.idle_since
        if idle.replicas == 0:
            self.steps_seen.pop(uid, None)
        return autoscaler.Decision(idle.replicas, decision.current, decision.average, idle.replicas,
                                   None if idle.replicas == 0 else decision.low_since, idle.reason,
                                   idle.message), idle.idle_since


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return status.now_iso(datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc))
