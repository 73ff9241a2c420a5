"""A minimal Kubernetes REST client for the node agent: bearer token, JSON in and out, watches.

Plain HTTP keeps the agent's behaviour obvious (which verb, which patch type) and independent of
the generated `kubernetes` client's model classes.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, body: str, method: str, path: str):
        super().__init__(f"{method} {path} -> {status}: {body[:300]}")
        self.status = status


class KubeHTTP:
    def __init__(self, server: str, token: str, ca_file: str):
        self.server = server.rstrip("/")
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        # Generous read timeout: watches hold the connection open for their timeoutSeconds.
        self._client = httpx.Client(
            base_url=self.server, headers=headers, verify=ssl.create_default_context(cafile=ca_file),
            timeout=httpx.Timeout(30.0, read=330.0),
        )

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None, params=None,
                content_type: str = "application/json") -> dict:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        resp = self._client.request(method, path, content=data, params=params, headers=headers)
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, resp.text, method, path)
        return resp.json() if resp.content else {}

    def get(self, path: str, params=None) -> dict:
        return self.request("GET", path, params=params)

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: dict) -> dict:
        # JSON merge patch: lists (conditions, containerStatuses) are replaced whole, so the
        # agent always sends complete lists and never ends up with two container states merged.
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: dict | None = None) -> dict:
        return self.request("DELETE", path, body)

    def watch(self, path: str, params: dict) -> Iterator[dict]:
        """Yield watch events ({"type", "object"}) until the server closes the stream."""
        params = dict(params, watch="true", allowWatchBookmarks="true")
        with self._client.stream("GET", path, params=params) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise ApiError(resp.status_code, resp.text, "WATCH", path)
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)
