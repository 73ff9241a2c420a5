"""The key check in front of LiteLLM's API routes: without a database, the master key is the only key.

LiteLLM validates keys other than the master key against its Postgres; with no database connected
it answers such a key with 400 "No connected db." A client with a wrong key must get 401, so this
ASGI wrapper refuses it before LiteLLM sees it. With DATABASE_URL set (virtual keys, per-key and
per-team limits in LiteLLM's database) other keys pass through to LiteLLM's own checks.
"""

from __future__ import annotations

import hmac
import json

# The OpenAI-shaped routes, with and without LiteLLM's /v1 prefix.
API_PREFIXES = ("/v1/", "/chat/", "/completions", "/models", "/embeddings")


def request_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, or the `api-key` / `x-api-key` headers LiteLLM accepts."""
    found = {}
    for name, value in headers:
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    auth = found.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return found.get("api-key") or found.get("x-api-key")


class MasterKeyOnly:
    def __init__(self, app, master_key: str, database: bool = False):
        self.app = app
        self.master_key = master_key.encode()
        self.database = database

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIXES) and not self.database:
            key = request_key(scope.get("headers") or [])
            if key is None or not hmac.compare_digest(key.encode(), self.master_key):
                await _unauthorized(send, "No API key passed in." if key is None else "Invalid API key.")
                return
        await self.app(scope, receive, send)


async def _unauthorized(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "auth_error", "param": None, "code": "401"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
