"""The operator's calls to the Kubernetes API: server-side apply of children, reads, the scale subresource.

A small JSON-over-HTTPS client: credentials come from the kubernetes library's config loaders
(in-cluster service account, else KUBECONFIG); requests and answers are plain dicts.
"""

from __future__ import annotations

import datetime
import ssl
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
from kubernetes import config as kube_config
from kubernetes.client import Configuration

from pagefleet.operator.resources import FIELD_MANAGER, GROUP, PLURAL, VERSION

# Who set spec.replicas, as managedFields and `kubectl get --show-managed-fields` tell it.
AUTOSCALER_FIELD_MANAGER = "pagefleet-autoscaler"

# Kinds the operator writes or reads -> (API prefix, plural).
PATHS = {
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("v1", "PersistentVolumeClaim"): ("/api/v1", "persistentvolumeclaims"),
    ("v1", "Event"): ("/api/v1", "events"),
    (f"{GROUP}/{VERSION}", "InferenceService"): (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class Kube:
    """One connection to the API server, safe to share between kopf's handler threads."""

    def __init__(self, configuration: Configuration):
        self.configuration = configuration
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        self.http = httpx.Client(base_url=configuration.host, verify=context, timeout=30.0)

    @classmethod
    def from_environment(cls) -> Kube:
        configuration = Configuration()
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=configuration)
        return cls(configuration)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        # The client library's own view of the credentials: bearer tokens (in-cluster ones are
        # re-read by its refresh hook as they rotate); client certificates are in the TLS context.
        for setting in self.configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    def request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                json: Any = None, content_type: str | None = None) -> dict[str, Any] | None:
        """One API call; None for 404, ApiError for any other failure."""
        response = self.http.request(method, path, params=params, json=json,
                                     headers=self._headers(content_type if json is not None else None))
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text)
        return response.json()

    # --- paths ---------------------------------------------------------------------------------

    @staticmethod
    def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = PATHS[(api_version, kind)]
        path = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
        return f"{path}/{quote(name)}" if name else path

    # --- writes --------------------------------------------------------------------------------

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates in place, owning exactly the fields the manifest sets."""
        meta = manifest["metadata"]
        path = self.path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        applied = self.request("PATCH", path, params={"fieldManager": FIELD_MANAGER, "force": "true"},
                               json=manifest, content_type="application/apply-patch+yaml")
        assert applied is not None
        return applied

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Sets an InferenceService's spec.replicas through its scale subresource, as `kubectl scale` does."""
        path = self.path(f"{GROUP}/{VERSION}", "InferenceService", namespace, name) + "/scale"
        self.request("PATCH", path, params={"fieldManager": AUTOSCALER_FIELD_MANAGER},
                     json={"spec": {"replicas": replicas}}, content_type="application/merge-patch+json")

    def patch_status(self, namespace: str, name: str, fields: Mapping[str, Any]) -> None:
        """Merge-patches status fields of an InferenceService (None removes a field)."""
        path = self.path(f"{GROUP}/{VERSION}", "InferenceService", namespace, name) + "/status"
        self.request("PATCH", path, params={"fieldManager": FIELD_MANAGER},
                     json={"status": dict(fields)}, content_type="application/merge-patch+json")

    def post_event(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A Kubernetes Event about the object, as `kubectl describe` and `kubectl get events` show it."""
        meta = body["metadata"]
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": body.get("apiVersion", f"{GROUP}/{VERSION}"),
                               "kind": body.get("kind", "InferenceService"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.request("POST", self.path("v1", "Event", meta["namespace"]), json=event)

    # --- reads ---------------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", self.path(api_version, kind, namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, *, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        params = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        found = self.request("GET", self.path(api_version, kind, namespace), params=params)
        return list((found or {}).get("items") or [])

    def mount_failures(self, namespace: str, pod_names: set[str]) -> dict[str, str]:
        """Pod name -> message of its latest FailedMount event, for the given pods."""
        events = self.list("v1", "Event", namespace, field_selector="involvedObject.kind=Pod,reason=FailedMount")
        events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return {e["involvedObject"]["name"]: e.get("message", "FailedMount")
                for e in events if e.get("involvedObject", {}).get("name") in pod_names}


_shared: Kube | None = None
_lock = threading.Lock()


def shared() -> Kube:
    """The process-wide client, made on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = Kube.from_environment()
        return _shared
