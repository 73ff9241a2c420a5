"""The prober (gateway/probe.py) against a small HTTP server on loopback that answers /load.

The real worker's /load is exercised by tests/gateway/test_gateway_e2e.py; here the answers are set by
the test so the bookkeeping (unreflected sends, down/up) can be checked exactly.
"""

import asyncio

import httpx
import prometheus_client
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from pagefleet.gateway.probe import Prober
from ports import free_port


@pytest.fixture
async def load_server():
    answer = {"waiting": 2, "running": 3, "kv_cache_usage": 0.25, "max_num_seqs": 4}

    async def load(_request):
        return JSONResponse(answer)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/load", load)]), host="127.0.0.1", port=port,
                                           log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", answer, server
    server.should_exit = True
    await task


async def test_probe_records_the_worker_load(load_server):
    url, answer, _ = load_server
    prober = Prober(interval_s=0.05)
    prober.add(url)
    prober.start()
    try:
        await asyncio.sleep(0.2)
        w = prober.snapshot(url)
        assert (w.up, w.waiting, w.running, w.kv_cache_usage, w.max_num_seqs) == (True, 2, 3, 0.25, 4)
        answer["waiting"] = 7
        await asyncio.sleep(0.2)
        assert prober.snapshot(url).waiting == 7 and prober.snapshot(url).lora_adapters == frozenset()
        answer["lora_adapters"] = {"sql": "/adapters/sql", "de": "/adapters/de"}  # the worker's name -> folder
        await asyncio.sleep(0.2)
        assert prober.snapshot(url).lora_adapters == {"sql", "de"}
        text = prometheus_client.generate_latest(prober.metrics.registry).decode()
        assert f'pagefleet_gateway_worker_waiting{{worker="{url}"}} 7.0' in text
        assert f'pagefleet_gateway_worker_up{{worker="{url}"}} 1.0' in text
    finally:
        await prober.stop()


async def test_sends_count_until_a_later_probe_reflects_them(load_server):
    url, _, _ = load_server
    prober = Prober(interval_s=10)  # probed by hand below
    prober._client = httpx.AsyncClient()
    prober.add(url)
    await prober.probe_once(url)
    prober.note_sent(url)
    prober.note_sent(url)
    assert prober.snapshot(url).unreflected == 2
    await prober.probe_once(url)  # issued after both sends: the worker's answer includes them
    assert prober.snapshot(url).unreflected == 0
    await prober._client.aclose()


async def test_unreachable_worker_is_down_and_failure_marks_down_at_once(load_server):
    url, _, server = load_server
    prober = Prober(interval_s=10, timeout_s=0.5)
    prober._client = httpx.AsyncClient()
    dead = f"http://127.0.0.1:{free_port()}"
    prober.add(url)
    prober.add(dead)
    await prober.probe_all()
    assert prober.snapshot(url).up is True and prober.snapshot(dead).up is False
    prober.note_failed(url)  # what the strategy's failure listener does on a refused connection
    assert prober.snapshot(url).up is False
    await prober.probe_once(url)
    assert prober.snapshot(url).up is True  # answers again: back in
    prober.remove(dead)
    assert prober.snapshot(dead) is None
    await prober._client.aclose()


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError):
        Prober(interval_s=0)


async def test_a_worker_that_says_it_is_draining_is_down(load_server):
    url, answer, _ = load_server
    prober = Prober(interval_s=10)
    prober._client = httpx.AsyncClient()
    prober.add(url)
    answer["draining"] = True
    await prober.probe_once(url)
    assert prober.snapshot(url).up is False
    answer["draining"] = False
    await prober.probe_once(url)
    assert prober.snapshot(url).up is True
    await prober._client.aclose()
