"""A gateway-wide cap on requests in flight, answered with 429 past it.

LiteLLM's own limits (per key, per team, per user: parallel requests, rpm, tpm, budgets) hang on
virtual keys in its Postgres; its `global_max_parallel_requests` setting did not limit anything in
our runs without one. This cap needs no database: it protects the workers' queues from a flood
through the master key. A stream counts until its last byte is sent.
"""

from __future__ import annotations

import json

from pagefleet.gateway.auth import API_PREFIXES


class InFlightLimit:
    def __init__(self, app, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.app = app
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIXES) or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            await _too_many(send, self.max_in_flight)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def _too_many(send, limit: int) -> None:
    body = json.dumps({"error": {"message": f"More than {limit} requests in flight through the gateway; retry later.",
                                 "type": "rate_limit_error", "param": None, "code": "429"}}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
