"""Status from the observed Deployment, pods and model source (no cluster)."""

import pytest

from pagefleet.operator import status

NOW = "2026-11-29T10:00:00Z"
LATER = "2026-11-29T10:05:00Z"


def body(generation=2, conditions=(), model=None):
    return {
        "metadata": {"name": "chat", "namespace": "serving", "generation": generation},
        "spec": {"model": model or {"name": "m", "hostPath": {"path": "/models/m"}}, "replicas": 2},
        "status": {"conditions": list(conditions)},
    }


def pod(name, ip, ready, started=True, terminating=False, crash=None):
    cs = {"name": "worker", "started": started, "ready": ready, "restartCount": 0,
          "state": {"running": {}} if started else {"waiting": {"reason": "ContainerCreating"}}}
    if crash:
        cs.update(state={"waiting": {"reason": "CrashLoopBackOff"}}, restartCount=4, started=False,
                  lastState={"terminated": {"reason": "Error", "message": crash}})
    meta = {"name": name}
    if terminating:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "status": {
        "podIP": ip, "containerStatuses": [cs],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def deployment(replicas, updated, available, generation=5, observed=5):
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "updatedReplicas": updated, "availableReplicas": available}}


MOUNTED = status.SourceCheck(True, "HostPathMounted", "ok")
UNKNOWN = status.SourceCheck(None, "WaitingForPods", "wait")


def conditions_by_type(st):
    return {c["type"]: c for c in st["conditions"]}


def test_all_ready_gives_ready_phase_and_sorted_endpoints():
    pods = [pod("b", "127.0.0.3", True), pod("a", "127.0.0.2", True)]
    st = status.compute(body(), deployment(2, 2, 2), pods, MOUNTED, desired=2, port=8000, now=NOW)
    assert st["phase"] == "Ready"
    assert st["replicas"] == 2 and st["readyReplicas"] == 2
    assert st["endpoints"] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
    conds = conditions_by_type(st)
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "WorkersReady"
    assert conds["Progressing"]["status"] == "False"
    assert conds["ModelSourceAvailable"]["status"] == "True"
    assert all(c["observedGeneration"] == 2 for c in st["conditions"])


def test_loading_then_progressing():
    loading = status.compute(body(), deployment(2, 2, 0), [pod("a", "127.0.0.2", False), pod("b", "127.0.0.3", False)],
                             UNKNOWN, desired=2, port=8000, now=NOW)
    assert loading["phase"] == "Loading" and loading["endpoints"] == []
    assert conditions_by_type(loading)["Ready"]["reason"] == "WorkersLoading"
    half = status.compute(body(), deployment(2, 2, 1), [pod("a", "127.0.0.2", True), pod("b", "127.0.0.3", False)],
                          MOUNTED, desired=2, port=8000, now=NOW)
    assert half["phase"] == "Progressing" and half["readyReplicas"] == 1
    assert conditions_by_type(half)["Ready"]["status"] == "True"
    assert conditions_by_type(half)["Progressing"]["status"] == "True"


def test_no_deployment_yet_is_pending():
    st = status.compute(body(), None, [], UNKNOWN, desired=2, port=8000, now=NOW)
    assert st["phase"] == "Pending"
    assert conditions_by_type(st)["Progressing"]["reason"] == "Creating"


def test_terminating_pods_are_neither_counted_nor_endpoints():
    pods = [pod("a", "127.0.0.2", True), pod("old", "127.0.0.9", True, terminating=True)]
    st = status.compute(body(), deployment(1, 1, 1), pods, MOUNTED, desired=1, port=8000, now=NOW)
    assert st["endpoints"] == ["http://127.0.0.2:8000"] and st["replicas"] == 1


def test_stale_deployment_generation_is_still_progressing():
    pods = [pod("a", "127.0.0.2", True), pod("b", "127.0.0.3", True)]
    st = status.compute(body(), deployment(2, 2, 2, generation=6, observed=5), pods, MOUNTED, desired=2,
                        port=8000, now=NOW)
    assert st["phase"] == "Progressing"


def test_missing_source_fails_with_its_reason():
    missing = status.SourceCheck(False, "ClaimNotFound", "PersistentVolumeClaim 'w' does not exist in this namespace")
    st = status.compute(body(), deployment(2, 2, 0), [], missing, desired=2, port=8000, now=NOW)
    assert st["phase"] == "Failed"
    conds = conditions_by_type(st)
    assert conds["ModelSourceAvailable"] == {
        "type": "ModelSourceAvailable", "status": "False", "reason": "ClaimNotFound",
        "message": "PersistentVolumeClaim 'w' does not exist in this namespace",
        "lastTransitionTime": NOW, "observedGeneration": 2}
    assert conds["Ready"]["reason"] == "ModelSourceUnavailable"


def test_crash_loop_is_reported():
    pods = [pod("a", "127.0.0.2", False, crash="CUDA out of memory")]
    st = status.compute(body(), deployment(1, 1, 0), pods, UNKNOWN, desired=1, port=8000, now=NOW)
    ready = conditions_by_type(st)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "WorkerCrashLoop"
    assert "CUDA out of memory" in ready["message"] and "restarts: 4" in ready["message"]


def test_transition_time_moves_only_when_status_changes():
    first = status.compute(body(), deployment(1, 1, 1), [pod("a", "127.0.0.2", True)], MOUNTED, desired=1,
                           port=8000, now=NOW)
    same = status.compute(body(conditions=first["conditions"]), deployment(1, 1, 1), [pod("a", "127.0.0.2", True)],
                          MOUNTED, desired=1, port=8000, now=LATER)
    assert conditions_by_type(same)["Ready"]["lastTransitionTime"] == NOW
    flipped = status.compute(body(conditions=first["conditions"]), deployment(1, 1, 0), [pod("a", "127.0.0.2", False)],
                             MOUNTED, desired=1, port=8000, now=LATER)
    assert conditions_by_type(flipped)["Ready"]["lastTransitionTime"] == LATER
    assert status.changed_fields(first, same) == {}
    assert set(status.changed_fields(first, flipped)) >= {"readyReplicas", "endpoints", "conditions"}


def test_scaled_to_zero_is_stopped():
    st = status.compute(body(), deployment(0, 0, 0), [], UNKNOWN, desired=0, port=8000, now=NOW)
    assert st["phase"] == "Stopped"


def test_pvc_source_checks():
    model = {"name": "m", "pvc": {"claimName": "weights"}}
    assert status.check_source(model, None, {}, []).reason == "ClaimNotFound"
    assert status.check_source(model, None, {}, []).available is False
    bound = {"status": {"phase": "Bound"}}
    assert status.check_source(model, bound, {}, []).available is True
    pending = status.check_source(model, {"status": {"phase": "Pending"}}, {}, [])
    assert pending.available is None and pending.reason == "ClaimPending"
    assert status.check_source(model, {"status": {"phase": "Lost"}}, {}, []).available is False


def test_hostpath_source_checks():
    model = {"name": "m", "hostPath": {"path": "/models/m"}}
    waiting = pod("a", "127.0.0.2", False, started=False)
    assert status.check_source(model, None, {}, [waiting]).available is None
    failed = status.check_source(model, None, {"a": "hostPath type check failed: /models/m is not a directory"},
                                 [waiting])
    assert failed.available is False and failed.reason == "MountFailed" and "/models/m" in failed.message
    # A failure event of a pod that has since started (the directory appeared) no longer counts.
    running = pod("a", "127.0.0.2", True)
    assert status.check_source(model, None, {"a": "old failure"}, [running]).available is True


# ---- a worker that exits at start-up: its message in the conditions -------------------------------

REFUSAL = "pagefleet serve: tensor_parallel_size 3 does not divide the model's 32 attention heads"
# FallbackToLogsOnError: the kubelet copies the log's tail; the error the worker exited with is its last line.
LOG_TAIL = f"INFO loading config from /models/m\nINFO tensor parallel: 3 ranks\n{REFUSAL}\n"


def exited_pod(name, state, last=None, restarts=0):
    cs = {"name": "worker", "started": False, "ready": False, "restartCount": restarts, "state": state}
    if last:
        cs["lastState"] = {"terminated": last}
    return {"metadata": {"name": name}, "status": {
        "podIP": "127.0.0.2", "containerStatuses": [cs], "conditions": [{"type": "Ready", "status": "False"}]}}


TERMINATED = {"terminated": {"exitCode": 2, "reason": "Error", "message": LOG_TAIL}}


@pytest.mark.parametrize("state, last", [
    (TERMINATED, None),  # exited just now
    ({"waiting": {"reason": "CrashLoopBackOff"}}, TERMINATED["terminated"]),  # waiting to be restarted
    ({"running": {}}, TERMINATED["terminated"]),  # restarted, not started yet
])
def test_worker_exit_before_start_is_degraded_with_its_message(state, last):
    pods = [exited_pod("chat-1", state, last, restarts=3)]
    st = status.compute(body(), deployment(1, 1, 0), pods, UNKNOWN, desired=1, port=8000, now=NOW)
    degraded = conditions_by_type(st)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "WorkerExited"
    assert degraded["message"] == f"pod chat-1: worker exited with code 2 (restarts: 3): {REFUSAL}"
    assert st["phase"] == "Failed"  # no worker ready and one failing: `kubectl get infsvc` says so
    ready = conditions_by_type(st)["Ready"]
    assert ready["status"] == "False" and REFUSAL in ready["message"] and "INFO" not in ready["message"]


def test_started_workers_and_clean_exits_are_not_degraded():
    fine = [pod("a", "127.0.0.2", True), pod("b", "127.0.0.3", False, started=False)]
    # A container that started, or one that exited 0, is no start failure.
    fine.append(exited_pod("c", {"terminated": {"exitCode": 0, "reason": "Completed"}}))
    st = status.compute(body(), deployment(3, 3, 1), fine, MOUNTED, desired=3, port=8000, now=NOW)
    degraded = conditions_by_type(st)["Degraded"]
    assert degraded["status"] == "False" and degraded["reason"] == "NoStartFailures"
    assert st["phase"] == "Progressing"


def test_one_failing_worker_beside_ready_ones_is_degraded_not_failed():
    pods = [pod("a", "127.0.0.2", True), exited_pod("b", {"waiting": {"reason": "CrashLoopBackOff"}},
                                                    {"exitCode": 137, "reason": "OOMKilled"}, restarts=1)]
    st = status.compute(body(), deployment(2, 2, 1), pods, MOUNTED, desired=2, port=8000, now=NOW)
    assert st["phase"] == "Progressing" and conditions_by_type(st)["Ready"]["status"] == "True"
    # No message (the kubelet killed it): the termination reason says what happened.
    degraded = conditions_by_type(st)["Degraded"]
    assert degraded["message"] == "pod b: worker exited with code 137 (restarts: 1): OOMKilled"


def test_worker_exited_event_once_when_degraded_turns_true():
    pods = [exited_pod("chat-1", TERMINATED)]
    healthy = status.compute(body(), deployment(1, 1, 0), [pod("a", "127.0.0.2", False)], UNKNOWN, desired=1,
                             port=8000, now=NOW)
    failing = status.compute(body(conditions=healthy["conditions"]), deployment(1, 1, 0), pods, UNKNOWN, desired=1,
                             port=8000, now=LATER)
    event = status.start_failure_event(healthy, failing)
    assert event == f"pod chat-1: worker exited with code 2 (restarts: 0): {REFUSAL}"
    assert status.start_failure_event({}, failing) is not None  # a status never written before
    # Still failing on the next pass (another restart): no second Event.
    again = status.compute(body(conditions=failing["conditions"]), deployment(1, 1, 0),
                           [exited_pod("chat-1", {"waiting": {"reason": "CrashLoopBackOff"}}, TERMINATED["terminated"],
                                       restarts=1)], UNKNOWN, desired=1, port=8000, now=LATER)
    assert status.start_failure_event(failing, again) is None
    assert status.start_failure_event(failing, healthy) is None


def test_last_line_of_a_termination_message():
    assert status.last_line(LOG_TAIL) == REFUSAL
    assert status.last_line("  \n") == "" and status.last_line(None) == ""
