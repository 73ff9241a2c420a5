"""`pagefleet serve --engine-process` (the step loop in a child process) against the in-process engine: two real
servers on the bundled model and the real openai client, token for token; then what crosses the process
boundary: aborts on disconnect, pause / resume, weight updates, engine errors as 400s, and a killed child.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import signal
import time

import httpx
import psutil
import pytest

from servers import AUTH, Server

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "16", "--enable-rl-endpoints")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(in-process server, engine-process server, a second engine-process server to kill), started side by side."""
    root = tmp_path_factory.mktemp("engine-process")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        ref = pool.submit(Server, root / "ref.log", *FLAGS, "--no-engine-process")  # whatever the environment says
        ep = pool.submit(Server, root / "ep.log", *FLAGS, "--engine-process")
        doomed = pool.submit(Server, root / "doomed.log", "--max-model-len", "64", "--engine-process")
        started = [ref.result(), ep.result(), doomed.result()]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def ref(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ep(servers):
    return servers[1]


@pytest.fixture(scope="module")
def doomed(servers):
    return servers[2]


def engine_child(server: Server) -> psutil.Process:
    children = [p for p in psutil.Process(server.proc.pid).children()
                if "engine_process" in " ".join(p.cmdline())]
    assert len(children) == 1, children
    return children[0]


def completion(server: Server, **kw) -> dict:
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 24, **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def choices(answer: dict) -> list:
    return [(c["index"], c["text"], c["finish_reason"], c["stop_reason"], c["logprobs"]) for c in answer["choices"]]


def test_the_engine_runs_in_a_child_process(ref, ep):
    assert engine_child(ep).is_running()
    assert not [p for p in psutil.Process(ref.proc.pid).children() if "engine_process" in " ".join(p.cmdline())]
    a, b = httpx.get(ref.url + "/load").json(), httpx.get(ep.url + "/load").json()
    assert a == b  # block size, KV blocks, max_num_seqs, weight version: the facts cross over


@pytest.mark.parametrize("kw", [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 7, "n": 3, "logprobs": 3},
    {"temperature": 0.8, "top_p": 0.9, "seed": 11, "stop": [" the", "."], "logprobs": 1},
    {"temperature": 0, "max_tokens": 160, "ignore_eos": True, "logprobs": 2},  # many steps of deltas
])
def test_outputs_match_the_in_process_engine(ref, ep, kw):
    a, b = completion(ref, **kw), completion(ep, **kw)
    assert choices(a) == choices(b)
    assert a["usage"] == b["usage"]
    if kw.get("ignore_eos"):
        assert b["usage"]["completion_tokens"] == kw["max_tokens"]


def test_streamed_logprobs_match(ref, ep):
    def streamed(server):
        stream = server.client().completions.create(model="smol", prompt="Once upon a time", max_tokens=24,
                                                    temperature=1.0, seed=3, n=2, logprobs=2, stream=True)
        text, tokens, finish = {}, {}, {}
        for chunk in stream:
            for c in chunk.choices:
                text[c.index] = text.get(c.index, "") + c.text
                tokens.setdefault(c.index, []).extend(zip(c.logprobs.tokens, c.logprobs.token_logprobs))
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        return text, tokens, finish

    a, b = streamed(ref), streamed(ep)
    assert a == b
    assert set(b[0]) == {0, 1} and all(len(t) == 24 for t in b[1].values())


def test_chat_stream_matches(ref, ep):
    def chat(server):
        stream = server.client().chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=30,
            temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert chat(ref) == chat(ep) != ""


def test_a_bad_request_is_a_400(ep):
    # rejected by the engine in the child (the grammar does not parse), its ValueError and its field kept
    r = httpx.post(ep.url + "/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": "smol", "messages": [{"role": "user", "content": "hi"}],
                         "structured_outputs": {"grammar": "root ::= ("}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text
    r = httpx.post(ep.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "smol", "prompt": [10 ** 9], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert completion(ep, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def wait_idle(server: Server, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        load = server.load()
        if load["running"] == 0 and load["waiting"] == 0:
            return load
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {load}")


def test_client_disconnect_frees_the_request(ep):
    async def leave_early():
        client = ep.aclient()
        stream = await client.completions.create(model="smol", prompt="Count:", max_tokens=400, stream=True,
                                                 extra_body={"ignore_eos": True})
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()
        await client.close()

    asyncio.run(leave_early())
    load = wait_idle(ep)
    assert load["kv_cache_usage"] == 0.0


def test_pause_holds_new_requests_until_resume(ep):
    def post(path, **body):
        return httpx.post(ep.url + path, json=body, headers=AUTH, timeout=60)

    assert post("/pause", mode="abort").status_code == 200
    assert httpx.get(ep.url + "/is_paused", headers=AUTH).json() == {"is_paused": True}
    again = post("/pause", mode="abort")  # the child's ValueError, a 400 here
    assert again.status_code == 400 and "paused already" in again.json()["error"]["message"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion, ep, max_tokens=4)
        time.sleep(1.0)
        assert not held.done()  # held in the child until resume
        assert ep.load()["waiting"] == 1
        assert post("/resume").status_code == 200
        assert held.result(timeout=60)["usage"]["completion_tokens"] == 4
    assert httpx.get(ep.url + "/is_paused", headers=AUTH).json() == {"is_paused": False}


def test_weight_update_bumps_the_version(ref, ep, smollm2_path):
    before = ep.load()["weight_version"]
    r = httpx.post(ep.url + "/update_weights_from_disk", json={"model_path": str(smollm2_path)}, headers=AUTH,
                   timeout=300)
    assert r.status_code == 200 and r.json()["weight_version"] == before + 1, r.text
    assert ep.load()["weight_version"] == before + 1  # the probes answer without a round trip, already updated
    assert choices(completion(ep, temperature=0)) == choices(completion(ref, temperature=0))  # the same weights
    bad = httpx.post(ep.url + "/update_weights_from_disk", json={"model_path": "/nonexistent"}, headers=AUTH,
                     timeout=60)
    assert bad.status_code == 400, bad.text


def test_metrics_and_steps_come_from_the_child(ep):
    steps = httpx.get(ep.url + "/debug/steps", headers=AUTH).json()
    assert steps["steps_total"] > 160 and len(steps["recent_steps"]) == min(steps["steps_total"], 2048)
    before = generation_tokens(ep)
    assert before > 160
    completion(ep, max_tokens=5, ignore_eos=True)
    assert generation_tokens(ep) == before + 5  # the last step's stats came with its outputs


def generation_tokens(server: Server) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", metrics, re.M).group(1))


def test_killed_child_ends_streams_and_fails_health(ep):
    """Last: it kills the engine of the module's server."""
    async def stream_then_kill():
        client = ep.aclient()
        stream = await client.completions.create(model="smol", prompt="Count:", max_tokens=400, stream=True,
                                                 extra_body={"ignore_eos": True})
        got = []
        async for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                engine_child(ep).send_signal(signal.SIGKILL)
        await client.close()
        return got

    t0 = time.time()
    with pytest.raises(Exception) as raised:  # the in-band error event ends the stream
        asyncio.run(asyncio.wait_for(stream_then_kill(), 30))
    assert time.time() - t0 < 30 and not isinstance(raised.value, asyncio.TimeoutError)
    assert "engine" in str(raised.value)
    assert httpx.get(ep.url + "/health").status_code == 503
    assert httpx.get(ep.url + "/ready").status_code == 503
    r = httpx.post(ep.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "smol", "prompt": "hi", "max_tokens": 2})
    assert r.status_code >= 500
    assert ep.proc.poll() is None  # the server itself stays up, reporting its engine dead


def test_the_child_dies_with_the_server(doomed):
    child = engine_child(doomed)
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    child.wait(timeout=15)  # psutil.TimeoutExpired if it outlived its server
