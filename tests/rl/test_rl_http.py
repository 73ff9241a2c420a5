"""The RL endpoints over HTTP: a real `pagefleet serve --enable-rl-endpoints` process on the bundled model, and a
plain one (no flag) started on a perturbed copy of the checkpoint, which is both the 404 check and the fresh
server that an update from disk must equal token for token.

The tests that need the engine's weight updates or sleep skip, naming what is missing, until the engine has them.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from servers import AUTH, Server

pytestmark = pytest.mark.slow

ROUTES = [("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
          ("POST", "/update_weights_from_distributed"), ("POST", "/update_weights_from_tensor"),
          ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"), ("POST", "/wake_up"),
          ("GET", "/is_sleeping")]


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory, smollm2_path):
    """The bundled checkpoint with every weight matrix nudged by seeded noise: other greedy outputs."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("new-weights") / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2_path, out)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.dim() == 2:
            tensors[name] = (t.float() + 0.02 * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def rl(tmp_path_factory):
    flags = ["--max-model-len", "256", "--max-num-seqs", "16", "--enable-rl-endpoints", "--enable-sleep-mode"]
    s = Server(tmp_path_factory.mktemp("rl") / "server.log", *flags)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, new_checkpoint):
    s = Server(tmp_path_factory.mktemp("plain") / "server.log", "--max-model-len", "256", "--max-num-seqs", "16",
               "--model", str(new_checkpoint))
    yield s
    s.stop()


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, headers=AUTH, timeout=120, **kw)


def greedy_text(server, prompt: str = "The capital of France is", max_tokens: int = 12) -> dict:
    r = post(server, "/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_routes_absent_without_the_flag(plain):
    for method, path in ROUTES:
        r = httpx.request(method, plain.url + path, headers=AUTH, json={})
        assert_error(r, 404)


def test_routes_need_the_api_key(rl):
    for method, path in ROUTES:
        r = httpx.request(method, rl.url + path, json={})
        assert_error(r, 401)
        r = httpx.request(method, rl.url + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)


def test_bad_bodies_are_400(rl):
    cases = [
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_disk", {"model_path": ""}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "x", "flush_cache": False}, "flush_cache"),
        ("/update_weights_from_disk", {"model_path": "x", "weight_version": "v7"}, "weight_version"),
        ("/update_weights_from_disk", {"model_path": "x", "load_format": "flattened_bucket"}, "load_format"),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[1], [2]]},
         "names"),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "names"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]}, "serialized_named_tensors"),
        ("/update_weights_from_tensor", {}, "serialized_named_tensors"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2,
                                        "world_size": 2}, "rank_offset"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1,
                                        "world_size": 2}, "master_port"),
        ("/pause", {"mode": "pause-please"}, "mode"),
    ]
    for path, body, param in cases:
        assert_error(post(rl, path, json=body), 400, param)
    assert_error(post(rl, "/pause", content=b"{not json"), 400)
    assert_error(post(rl, "/pause", params={"mode": "later"}), 400, "mode")
    assert_error(post(rl, "/sleep", params={"level": 3}), 400, "level")
    assert_error(post(rl, "/sleep", params={"level": "deep"}), 400)
    assert_error(post(rl, "/wake_up", params={"tags": ["weights", "gpu"]}), 400, "tags")
    assert_error(post(rl, "/resume"), 400)  # not paused
    assert httpx.get(rl.url + "/is_paused", headers=AUTH).json() == {"is_paused": False}
    assert httpx.get(rl.url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_update_from_disk_equals_a_fresh_server(rl, plain, new_checkpoint):
    before = greedy_text(rl)
    version = rl.load()["weight_version"]
    want = greedy_text(plain)
    assert want["choices"][0]["text"] != before["choices"][0]["text"]  # the perturbation shows
    assert_error(post(rl, "/update_weights_from_disk", json={"model_path": str(new_checkpoint / "missing")}), 400)
    assert greedy_text(rl)["choices"][0]["text"] == before["choices"][0]["text"]  # a refused update changes nothing
    r = post(rl, "/update_weights_from_disk", json={"model_path": str(new_checkpoint)})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weight_version"] == version + 1
    assert rl.load()["weight_version"] == version + 1
    after = greedy_text(rl)
    assert after["choices"][0]["text"] == want["choices"][0]["text"]
    assert after["weight_version"] == version + 1 and before["weight_version"] == version


async def _stream_first_token(client: httpx.AsyncClient, url: str, max_tokens: int):
    """Start a streaming completion; returns (task reading the rest -> (text, finish reason), first text)."""
    body = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    import json

    resp_cm = client.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=300)
    resp = await resp_cm.__aenter__()
    lines = resp.aiter_lines()
    first = None
    async for line in lines:
        if line.startswith("data: {"):
            first = json.loads(line[6:])["choices"][0]["text"]
            break

    async def rest():
        text, finish = first, None
        async for line in lines:
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                finish = c["finish_reason"] or finish
        await resp_cm.__aexit__(None, None, None)
        return text, finish

    return asyncio.create_task(rest()), first


async def test_pause_modes_over_http(rl):
    async with httpx.AsyncClient() as client:
        # abort: the in-flight request ends now with finish reason abort; a new one waits for resume
        rest, _ = await _stream_first_token(client, rl.url, 200)
        r = await client.post(rl.url + "/pause", json={"mode": "abort"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["is_paused"] is True, r.text
        text, finish = await asyncio.wait_for(rest, 60)
        assert finish == "abort"
        held = asyncio.create_task(client.post(rl.url + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": "smol", "prompt": "Hi", "max_tokens": 4, "temperature": 0}))
        await asyncio.sleep(1.0)
        assert not held.done()  # paused: nothing runs
        assert (await client.get(rl.url + "/is_paused", headers=AUTH)).json() == {"is_paused": True}
        assert (await client.post(rl.url + "/resume", headers=AUTH)).status_code == 200
        assert (await asyncio.wait_for(held, 60)).status_code == 200

        # keep: the request stays, unstepped, and finishes all its tokens after resume (200 tokens: it must not
        # finish before the pause lands, which with --engine-process crosses a process boundary)
        rest, _ = await _stream_first_token(client, rl.url, 200)
        assert (await client.post(rl.url + "/pause", params={"mode": "keep"}, headers=AUTH)).status_code == 200
        await asyncio.sleep(1.0)
        assert not rest.done()
        assert (await client.post(rl.url + "/resume", headers=AUTH)).status_code == 200
        text, finish = await asyncio.wait_for(rest, 120)
        assert finish == "length"

        # wait: /pause answers only once the in-flight request has finished; the event loop serves meanwhile
        rest, _ = await _stream_first_token(client, rl.url, 40)
        pause = asyncio.create_task(client.post(rl.url + "/pause", json={"mode": "wait"}, headers=AUTH, timeout=120))
        await asyncio.sleep(0.2)
        assert (await client.get(rl.url + "/load", timeout=2)).status_code == 200  # not blocked by the drain
        r = await asyncio.wait_for(pause, 120)
        assert r.status_code == 200, r.text
        # drained before /pause answered: the server says so; the stream's last chunk may still be on its way
        load = (await client.get(rl.url + "/load", timeout=2)).json()
        assert load["running"] == 0 and load["waiting"] == 0, load
        assert (await asyncio.wait_for(rest, 10))[1] == "length"
        assert (await client.post(rl.url + "/resume", headers=AUTH)).status_code == 200


def test_sleep_then_wake(rl):
    want = greedy_text(rl)["choices"][0]["text"]
    r = post(rl, "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert httpx.get(rl.url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    ready = httpx.get(rl.url + "/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    r = post(rl, "/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert_error(r, 503)
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "sleeping"
    r = post(rl, "/wake_up")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False, r.text
    assert httpx.get(rl.url + "/ready").status_code == 200
    assert greedy_text(rl)["choices"][0]["text"] == want
