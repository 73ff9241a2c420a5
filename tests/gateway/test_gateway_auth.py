"""The master-key check in front of LiteLLM's API routes (gateway/auth.py)."""

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagefleet.gateway.auth import MasterKeyOnly, request_key


async def ok(_request):
    return PlainTextResponse("reached")


INNER = Starlette(routes=[Route("/v1/models", ok), Route("/chat/completions", ok, methods=["POST"]),
                          Route("/health/liveliness", ok)])


async def get(app, path, headers=None, method="GET"):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.request(method, path, headers=headers or {})


async def test_master_key_passes_others_get_401():
    app = MasterKeyOnly(INNER, "sk-master")
    assert (await get(app, "/v1/models", {"Authorization": "Bearer sk-master"})).text == "reached"
    assert (await get(app, "/v1/models", {"x-api-key": "sk-master"})).text == "reached"
    wrong = await get(app, "/v1/models", {"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "Invalid API key."
    missing = await get(app, "/chat/completions", method="POST")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "auth_error"


async def test_health_is_open_and_a_database_defers_to_litellm():
    assert (await get(MasterKeyOnly(INNER, "sk-master"), "/health/liveliness")).text == "reached"
    with_db = MasterKeyOnly(INNER, "sk-master", database=True)
    assert (await get(with_db, "/v1/models", {"Authorization": "Bearer sk-virtual"})).text == "reached"


def test_key_headers():
    assert request_key([(b"authorization", b"Bearer sk-a")]) == "sk-a"
    assert request_key([(b"Api-Key", b"sk-b")]) == "sk-b"
    assert request_key([(b"authorization", b"Basic xyz")]) is None
