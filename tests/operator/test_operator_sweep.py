"""The sweep's status pass through the real API client, against an API server that answers from memory: the
status patch, and the WorkerExited Event a worker's exit message goes into (no cluster)."""

import json

import httpx
from kubernetes.client import Configuration

from pagefleet.operator import kube, sweep

REFUSAL = "pagefleet serve: tensor_parallel_size 3 does not divide the model's 32 attention heads"
ISVC = "/apis/pagefleet.io/v1alpha1/namespaces/serving/inferenceservices/chat"


def inference_service(status=None):
    return {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "serving", "uid": "u-1", "generation": 1},
            "spec": {"model": {"name": "m", "hostPath": {"path": "/m"}}, "replicas": 1,
                     "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 4}},
            "status": status or {}}


def crash_looping_pod(restarts):
    return {"metadata": {"name": "chat-6f7-x", "ownerReferences": [{"kind": "ReplicaSet", "name": "chat-6f7"}]},
            "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [{
                           "name": "worker", "started": False, "ready": False, "restartCount": restarts,
                           "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                           "lastState": {"terminated": {"exitCode": 2, "reason": "Error",
                                                        "message": f"INFO starting 4 ranks\n{REFUSAL}\n"}}}]}}


class ApiServer:
    """What the sweep reads (a Deployment, its pods, no mount events) and what it writes (status, Events)."""

    def __init__(self):
        self.pods = [crash_looping_pod(restarts=1)]
        self.status_patches, self.events = [], []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if method == "GET" and path == "/apis/apps/v1/namespaces/serving/deployments/chat":
            return httpx.Response(200, json={"metadata": {"name": "chat", "generation": 1}, "status": {
                "observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 0}})
        if method == "GET" and path == "/api/v1/namespaces/serving/pods":
            assert request.url.params["labelSelector"] == "pagefleet.io/inference-service=chat"
            return httpx.Response(200, json={"items": self.pods})
        if method == "GET" and path == "/api/v1/namespaces/serving/events":
            return httpx.Response(200, json={"items": []})
        if method == "PATCH" and path == ISVC + "/status":
            self.status_patches.append(json.loads(request.content)["status"])
            return httpx.Response(200, json={})
        if method == "POST" and path == "/api/v1/namespaces/serving/events":
            self.events.append(json.loads(request.content))
            return httpx.Response(201, json={})
        return httpx.Response(404, json={})


def client_for(server):
    client = kube.Kube(Configuration(host="https://api.test"))
    client.http = httpx.Client(base_url="https://api.test", transport=httpx.MockTransport(server))
    return client


def test_a_worker_exit_is_in_status_and_one_warning_event():
    server = ApiServer()
    sweeper = sweep.Sweeper(client_for(server), status_interval=3, autoscale_interval=5)
    sweeper.refresh_status(inference_service())
    (patch,) = server.status_patches
    degraded = next(c for c in patch["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "WorkerExited"
    assert degraded["message"] == f"pod chat-6f7-x: worker exited with code 2 (restarts: 1): {REFUSAL}"
    assert patch["phase"] == "Failed"
    (event,) = server.events
    assert (event["type"], event["reason"], event["message"]) == ("Warning", "WorkerExited", degraded["message"])
    assert event["involvedObject"] == {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceService",
                                       "name": "chat", "namespace": "serving", "uid": "u-1"}

    # The next pass: the crash loop restarted the worker once more. The status moves, no second Event.
    server.pods = [crash_looping_pod(restarts=2)]
    sweeper.refresh_status(inference_service(status=patch))
    assert len(server.status_patches) == 2 and "restarts: 2" in json.dumps(server.status_patches[1])
    assert len(server.events) == 1
