"""The worker's OpenAI app in this process, reached over ASGI: for HTTP tests that need no server process
(tests/engine, tests/entrypoints)."""

from __future__ import annotations

import contextlib

import httpx

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.entrypoints.api_server import build_app


@contextlib.contextmanager
def worker_app(model, engine_args: dict, served_model_name: str = "smol", **app_args):
    """build_app over an AsyncLLMEngine on `model` (EngineConfig's engine_args), shut down on leaving."""
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=str(model), **engine_args))
    try:
        yield build_app(engine, served_model_name, **app_args)
    finally:
        engine.shutdown()


async def post(app, path: str, **body) -> httpx.Response:
    """One POST with this JSON body, answered whole (a stream's events are in its text)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://pagefleet", timeout=60) as c:
        return await c.post(path, json=body)
