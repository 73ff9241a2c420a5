"""What an InferenceService's status should say, from what its Deployment, pods and model source show.

Pure: the observations come in as plain dicts (as the API server returns them), the status goes out as one.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagefleet.operator import scale_to_zero

READY = "Ready"
MODEL_SOURCE_AVAILABLE = "ModelSourceAvailable"
PROGRESSING = "Progressing"
IDLE = "Idle"  # the condition, only with scale to zero: True while at 0 replicas
# True while a worker that exited with an error has not started again: a flag refused at start-up, a checkpoint
# it cannot read, an out-of-memory kill. Its reason is also the reason of the Warning Event posted with it.
DEGRADED, WORKER_EXITED = "Degraded", "WorkerExited"

PENDING, LOADING, PROGRESSING_PHASE, READY_PHASE, FAILED, STOPPED, IDLE_PHASE = (
    "Pending", "Loading", "Progressing", "Ready", "Failed", "Stopped", "Idle")


@dataclass(frozen=True)
class SourceCheck:
    """Whether the model's checkpoint can be mounted: True, False or None (not known yet)."""

    available: bool | None
    reason: str
    message: str


def now_iso(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    if pod_is_terminating(pod) or not pod.get("status", {}).get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions") or [])


def endpoints(pods: Sequence[Mapping[str, Any]], port: int) -> list[str]:
    """URLs of the ready pods, sorted so that an unchanged set gives an unchanged status."""
    return sorted(f"http://{p['status']['podIP']}:{port}" for p in pods if pod_is_ready(p))


def last_line(message: str | None) -> str:
    """The last non-empty line of a termination message. The worker container's policy is FallbackToLogsOnError,
    so the message of a worker that wrote none is its log's tail, and the error it exited with is the last line."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def crash_looping(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """A message about the first worker container stuck in CrashLoopBackOff, if any."""
    for pod in pods:
        for cs in pod.get("status", {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff":
                last = ((cs.get("lastState") or {}).get("terminated") or {})
                detail = last_line(last.get("message")) or last.get("reason") or waiting.get("message") or ""
                restarts = cs.get("restartCount", 0)
                return f"pod {pod['metadata']['name']} keeps crashing (restarts: {restarts}) {detail}".strip()
    return None


def failed_termination(cs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The failed exit of a container that has not started since: it is terminated with a non-zero code now,
    or waits in CrashLoopBackOff, or runs again unstarted, after one. None for a container that started."""
    state, last = cs.get("state") or {}, (cs.get("lastState") or {}).get("terminated")
    if cs.get("started") or cs.get("ready"):
        return None
    now = state.get("terminated")
    if now:
        return now if now.get("exitCode", 0) != 0 else None
    if last and last.get("exitCode", 0) != 0 and ("waiting" in state or "running" in state):
        return last
    return None


def start_failure(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """A message about the first worker that exited before it started, with the error it printed, if any."""
    for pod in pods:
        for cs in pod.get("status", {}).get("containerStatuses") or []:
            failed = failed_termination(cs)
            if failed is None:
                continue
            detail = last_line(failed.get("message")) or failed.get("reason") or "no message"
            return (f"pod {pod['metadata']['name']}: worker exited with code {failed.get('exitCode')} "
                    f"(restarts: {cs.get('restartCount', 0)}): {detail}")
    return None


def start_failure_event(current: Mapping[str, Any], observed: Mapping[str, Any]) -> str | None:
    """The message of the WorkerExited Event to post: the Degraded condition of `observed` turns True (it
    is not True in the `current` status). Once per failure, not once per restart of the crash loop."""
    def degraded(st: Mapping[str, Any]) -> Mapping[str, Any]:
        return next((c for c in st.get("conditions") or [] if c.get("type") == DEGRADED), {})
    new = degraded(observed)
    if new.get("status") == "True" and degraded(current).get("status") != "True":
        return new.get("message")
    return None


def rollout_complete(deployment: Mapping[str, Any] | None, desired: int) -> bool:
    """The Deployment has seen its latest spec and runs exactly `desired` up-to-date, available pods."""
    if not deployment:
        return False
    st = deployment.get("status") or {}
    return (st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
            and st.get("updatedReplicas", 0) == desired
            and st.get("availableReplicas", 0) == desired
            and st.get("replicas", 0) == desired)


def condition(conditions: Sequence[Mapping[str, Any]], type_: str, status: bool | None, reason: str, message: str,
              generation: int, now: str) -> dict[str, Any]:
    """A condition; lastTransitionTime moves only when the status itself changes."""
    value = {True: "True", False: "False", None: "Unknown"}[status]
    previous = next((c for c in conditions if c.get("type") == type_), None)
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == value else None
    return {"type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since or now, "observedGeneration": generation}


def compute(body: Mapping[str, Any], deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]],
            source: SourceCheck, desired: int, port: int, now: str) -> dict[str, Any]:
    """The status fields the operator owns (everything but observedGeneration, selector and autoscaling)."""
    previous = (body.get("status") or {}).get("conditions") or []
    generation = body["metadata"].get("generation", 0)
    live = [p for p in pods if not pod_is_terminating(p)]
    urls = endpoints(live, port)
    ready = len(urls)
    crash = crash_looping(live)
    start_failed = start_failure(live) if desired > 0 else None
    done = rollout_complete(deployment, desired) and len(live) == desired

    to_zero = scale_to_zero.enabled(body["spec"])
    if source.available is False or (start_failed and ready == 0):
        phase = FAILED
    elif desired == 0:
        phase = IDLE_PHASE if to_zero else STOPPED
    elif ready == 0:
        phase = LOADING if live else PENDING
    elif done and ready == desired:
        phase = READY_PHASE
    else:
        phase = PROGRESSING_PHASE

    if ready > 0:
        ready_cond = (True, "WorkersReady", f"{ready} of {desired} worker(s) ready")
    elif source.available is False:
        ready_cond = (False, "ModelSourceUnavailable", source.message)
    elif crash:
        ready_cond = (False, "WorkerCrashLoop", crash)
    elif start_failed:
        ready_cond = (False, WORKER_EXITED, start_failed)
    elif desired == 0:
        ready_cond = (False, "ScaledToZero", "idle at 0 replicas: a request at the gateway starts a worker"
                      if to_zero else "spec.replicas is 0")
    elif live:
        ready_cond = (False, "WorkersLoading", f"{len(live)} worker(s) starting, none ready yet")
    else:
        ready_cond = (False, "NoWorkers", "no worker pod exists yet")

    if done:
        progressing = (False, "RolloutComplete", f"{desired} up-to-date worker(s) available")
    elif deployment is None:
        progressing = (True, "Creating", "the worker Deployment is being created")
    else:
        st = deployment.get("status") or {}
        progressing = (True, "RollingOut",
                       f"{st.get('updatedReplicas', 0)} updated, {st.get('availableReplicas', 0)} available, "
                       f"{len(live)} running of {desired} desired")

    conditions = [
        condition(previous, READY, *ready_cond, generation, now),
        condition(previous, MODEL_SOURCE_AVAILABLE, source.available, source.reason, source.message, generation, now),
        condition(previous, PROGRESSING, *progressing, generation, now),
        condition(previous, DEGRADED, *((True, WORKER_EXITED, start_failed) if start_failed else
                                        (False, "NoStartFailures", "no worker has exited before it started")),
                  generation, now),
    ]
    if to_zero:
        after = body["spec"]["autoscaling"].get("scaleToZeroAfterSeconds")
        idle = ((True, scale_to_zero.SCALED_TO_ZERO, "no worker runs; the gateway holds the next request and "
                 "scales to 1") if desired == 0 else
                (False, "Serving", f"{desired} worker(s) wanted; 0 after {after}s without a request"))
        conditions.append(condition(previous, IDLE, *idle, generation, now))
    observed = {
        "phase": phase,
        "replicas": len(live),
        "readyReplicas": ready,
        "endpoints": urls,
        "conditions": conditions,
    }
    started = last_start_seconds(live)
    if started is not None:
        observed["lastStartSeconds"] = started
    return observed


def epoch(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def last_start_seconds(pods: Sequence[Mapping[str, Any]]) -> int | None:
    """Seconds from creation to Ready of the newest ready pod: what a start from zero costs, scheduling and
    the worker's own start-up together (the API's timestamps have whole seconds). None without a ready pod."""
    starts = []
    for pod in pods:
        ready = next((c for c in pod.get("status", {}).get("conditions") or []
                      if c.get("type") == "Ready" and c.get("status") == "True"), None)
        created = epoch(pod.get("metadata", {}).get("creationTimestamp"))
        became_ready = epoch((ready or {}).get("lastTransitionTime"))
        if created is not None and became_ready is not None:
            starts.append((created, int(became_ready - created)))
    return max(starts)[1] if starts else None


def changed_fields(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The wanted fields that differ from the current status (an empty dict: nothing to patch)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def container_started(pod: Mapping[str, Any]) -> bool:
    return any(cs.get("started") or (cs.get("state") or {}).get("running")
               for cs in pod.get("status", {}).get("containerStatuses") or [])


def check_source(model: Mapping[str, Any], claim: Mapping[str, Any] | None, mount_failures: Mapping[str, str],
                 pods: Sequence[Mapping[str, Any]]) -> SourceCheck:
    """Whether the checkpoint can be mounted, from the claim (pvc source), the pods and their FailedMount events.

    `mount_failures` maps a pod name to the message of its latest FailedMount event. A hostPath lies on
    the nodes, out of the operator's sight: it is known missing when the kubelet refuses to mount it,
    and known present once a worker container has started with it.
    """
    live = [p for p in pods if not pod_is_terminating(p)]
    failing = [mount_failures[p["metadata"]["name"]] for p in live
               if p["metadata"]["name"] in mount_failures and not container_started(p)]
    if failing:
        return SourceCheck(False, "MountFailed", failing[0])
    if "pvc" in model:
        name = model["pvc"]["claimName"]
        if claim is None:
            return SourceCheck(False, "ClaimNotFound",
                               f"PersistentVolumeClaim {name!r} does not exist in this namespace")
        phase = (claim.get("status") or {}).get("phase")
        if phase == "Bound":
            return SourceCheck(True, "ClaimBound", f"PersistentVolumeClaim {name!r} is bound")
        if phase == "Lost":
            return SourceCheck(False, "ClaimLost", f"PersistentVolumeClaim {name!r} lost its volume")
        # WaitForFirstConsumer claims bind only once a worker pod is scheduled.
        return SourceCheck(None, "ClaimPending", f"PersistentVolumeClaim {name!r} is {phase or 'not bound yet'}")
    path = model["hostPath"]["path"]
    if any(container_started(p) for p in live):
        return SourceCheck(True, "HostPathMounted", f"{path} is mounted in the running workers")
    return SourceCheck(None, "WaitingForPods", f"{path} is checked on the node when a worker pod starts")
