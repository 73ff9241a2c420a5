"""The gateway-wide in-flight cap (gateway/limits.py): 429 past it, streams count until they end."""

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagefleet.gateway.limits import InFlightLimit


async def test_requests_past_the_cap_get_429_and_the_slot_is_freed():
    release = asyncio.Event()

    async def slow(_request):
        await release.wait()
        return PlainTextResponse("done")

    inner = Starlette(routes=[Route("/v1/completions", slow, methods=["POST"]),
                              Route("/v1/models", lambda r: PlainTextResponse("models"))])
    app = InFlightLimit(inner, 2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        first = [asyncio.create_task(c.post("/v1/completions")) for _ in range(2)]
        while app.in_flight < 2:
            await asyncio.sleep(0.01)
        refused = await c.post("/v1/completions")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert (await c.get("/v1/models")).text == "models"  # reads are not capped
        release.set()
        assert [r.text for r in await asyncio.gather(*first)] == ["done", "done"]
        assert app.in_flight == 0
        assert (await c.post("/v1/completions")).text == "done"


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError):
        InFlightLimit(None, 0)
