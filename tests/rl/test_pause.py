"""Pause and resume around a weight update (engine/weight_updates.py, the async engine, POST /pause): abort ends
the samples in flight with finish reason "abort"; wait drains them under the old weights; keep holds them with
their KV cache across the update, and they go on under the new weights, their outputs saying which version
produced which tokens. New requests wait for resume in every mode; an update between the tokens of samples
that are not held is refused. Token-exact on a tiny real Llama checkpoint and a perturbed copy of it: the
tokens of a kept sample before the update are an old engine's, those after it are transformers' greedy tokens
of the new weights over the old weights' KV cache.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from test_weight_updates import perturbed

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.engine.async_engine import AsyncLLMEngine
from servers import AUTH, Server

PROMPTS = [[5, 9, 200, 7], list(range(100, 130))]
MAX_TOKENS = 48
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=32, device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    old = tiny_models["llama"]
    return old, perturbed(old, tmp_path_factory.mktemp("pause") / "llama-new", seed=1)


@pytest.fixture(scope="module")
def refs(checkpoints):
    """Greedy tokens of each prompt from a fresh engine of the old and of the new weights."""
    def greedy(path):
        return [o.outputs[0].token_ids for o in LLM(str(path), **ENGINE_ARGS).generate(PROMPTS, PARAMS)]

    old, new = checkpoints
    out = {"old": greedy(old), "new": greedy(new)}
    assert all(a[0] != b[0] for a, b in zip(out["old"], out["new"], strict=True))  # the new weights show at once
    return out


def hf_kept(old, new, prompt: list[int], first: list[int], total: int) -> list[int]:
    """transformers, fp32: the greedy tokens of a sample whose first len(first) tokens came from the old weights
    and whose K/V up to then were computed by them; the rest by the new weights over that cache."""
    from transformers import AutoModelForCausalLM

    m_old, m_new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (old, new))
    tokens = list(first)
    with torch.inference_mode():
        cache = m_old(torch.tensor([prompt + tokens[:-1]]), use_cache=True).past_key_values
        while len(tokens) < total:
            out = m_new(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def engine(path, **kw) -> LLM:
    return LLM(str(path), **{**ENGINE_ARGS, **kw})


def start(llm: LLM, tokens: int, prompts=PROMPTS) -> list[str]:
    """Add the prompts as requests and step until each sample has `tokens` output tokens or more."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm.engine.add_request(request_id, prompt, PARAMS)
    while min(llm.engine.requests[r].seqs[0].num_output_tokens for r in ids) < tokens:
        assert not llm.engine.step()  # offline: nothing is reported before a request ends
    return ids


def run_to_end(llm: LLM) -> dict:
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    return done


def test_abort_ends_the_samples_in_flight_then_the_update_runs(checkpoints, refs):
    old, new = checkpoints
    llm = engine(old)
    free = llm.engine.block_manager.num_free_blocks
    ids = start(llm, 3)
    outs = {o.request_id: o for o in llm.pause("abort")}
    assert set(outs) == set(ids) and llm.is_paused
    for i, request_id in enumerate(ids):
        o = outs[request_id]
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "abort"
        assert 3 <= len(c.token_ids) < MAX_TOKENS and c.token_ids == refs["old"][i][:len(c.token_ids)]
        assert o.weight_versions == [0] and c.weight_versions == [(0, 0)]
    assert not llm.engine.requests and llm.engine.block_manager.num_free_blocks == free  # their KV is freed
    assert llm.update_weights_from_disk(str(new)) == 1
    llm.resume()
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == refs["new"]
    assert all(o.weight_versions == [1] and o.weight_version == 1 for o in outs)


def test_wait_drains_under_the_old_weights_then_the_update_runs(checkpoints, refs):
    old, new = checkpoints
    llm = engine(old)
    ids = start(llm, 3)
    outs = {o.request_id: o for o in llm.pause("wait")}
    assert set(outs) == set(ids)
    for i, request_id in enumerate(ids):
        assert outs[request_id].outputs[0].finish_reason == "length"
        assert outs[request_id].outputs[0].token_ids == refs["old"][i]  # every token from the old weights
        assert outs[request_id].weight_versions == [0]
    llm.engine.add_request("late", PROMPTS[0], PARAMS)  # arrives during the pause: waits for resume
    assert not llm.engine.has_unfinished_requests() and llm.engine.step() == []
    assert llm.update_weights_from_disk(str(new)) == 1
    llm.resume()
    late = run_to_end(llm)["late"]
    assert late.outputs[0].token_ids == refs["new"][0]
    assert late.weight_versions == [1] and late.outputs[0].weight_versions == [(1, 0)]


def test_keep_holds_the_samples_and_their_kv_across_an_update(checkpoints, refs):
    old, new = checkpoints
    llm = engine(old)
    e = llm.engine
    ids = start(llm, 5)
    assert llm.pause("keep") == []  # nothing ended; the step on the device is read back
    seqs = [e.requests[r].seqs[0] for r in ids]
    kept = [list(s.output_token_ids) for s in seqs]
    tables = [list(s.block_table) for s in seqs]
    for _ in range(3):  # held: nothing runs
        assert e.step() == []
    assert not e.has_unfinished_requests()
    assert [s.output_token_ids for s in seqs] == kept
    assert llm.update_weights_from_disk(str(new)) == 1
    assert [s.block_table for s in seqs] == tables  # their K/V of the old weights stays theirs
    llm.resume()
    outs = run_to_end(llm)
    for i, (request_id, first) in enumerate(zip(ids, kept, strict=True)):
        o, k = outs[request_id], len(first)
        tokens = o.outputs[0].token_ids
        assert len(tokens) == MAX_TOKENS and o.outputs[0].finish_reason == "length"
        assert o.weight_versions == [0, 1] and o.weight_version == 1
        assert o.outputs[0].weight_versions == [(0, 0), (1, k)]  # tokens [0, k) old, [k, ...) new
        assert tokens[:k] == refs["old"][i][:k]
        assert tokens[k:] != refs["old"][i][k:]
        assert tokens == hf_kept(old, new, PROMPTS[i], first, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_new_requests_wait_for_resume_in_every_mode(checkpoints, refs, mode):
    old, _ = checkpoints
    llm = engine(old, max_num_seqs=1)  # r1 queues behind r0, with nothing computed
    e = llm.engine
    start(llm, 2, PROMPTS[:1])
    e.add_request("queued", PROMPTS[1], PARAMS)
    e.step()
    assert e.requests["queued"].seqs[0].num_computed_tokens == 0
    before = {o.request_id: o for o in llm.pause(mode)}
    e.add_request("late", PROMPTS[0], PARAMS)
    for _ in range(3):
        e.step()
    assert not e.has_unfinished_requests()
    if mode == "abort":  # every request of the engine ends, queued or not
        assert {r: o.outputs[0].finish_reason for r, o in before.items()} == {"r0": "abort", "queued": "abort"}
    elif mode == "wait":  # the started one drained; the queued one waits with the late one
        assert before["r0"].outputs[0].token_ids == refs["old"][0] and "queued" not in before
    else:
        assert before == {}
    for request_id in ("queued", "late"):
        if request_id in e.requests:
            assert e.requests[request_id].seqs[0].num_computed_tokens == 0
    with pytest.raises(ValueError, match="paused"):
        llm.generate(PROMPTS[:1], PARAMS)  # offline generate cannot wait for a resume that only it could call
    llm.resume()
    outs = run_to_end(llm)
    assert outs["late"].outputs[0].token_ids == refs["old"][0]
    if mode != "abort":
        assert outs["queued"].outputs[0].token_ids == refs["old"][1]
    if mode == "keep":
        assert outs["r0"].outputs[0].token_ids == refs["old"][0]


def test_an_update_between_tokens_of_samples_not_held_is_refused(checkpoints, refs):
    """Never two policies in one sample: with requests running and no pause("keep"), every source of new
    weights is refused, and the samples end with the old weights' tokens only."""
    from safetensors.torch import load_file

    old, new = checkpoints
    llm = engine(old)
    ids = start(llm, 2)
    with pytest.raises(ValueError, match=r"2 sequence\(s\) are running.*pause"):
        llm.update_weights_from_disk(str(new))
    with pytest.raises(ValueError, match="running"):
        llm.update_weights_from_tensor(load_file(new / "model.safetensors"))
    assert llm.weight_version == 0
    outs = run_to_end(llm)
    assert [outs[r].outputs[0].token_ids for r in ids] == refs["old"]
    assert all(outs[r].weight_versions == [0] for r in ids)


def test_pause_misuse_is_a_clear_error(checkpoints):
    llm = engine(checkpoints[0])
    with pytest.raises(ValueError, match="not paused"):
        llm.resume()
    with pytest.raises(ValueError, match="pause mode 'later': one of abort, wait, keep"):
        llm.pause("later")
    assert not llm.is_paused
    llm.pause("keep")
    with pytest.raises(ValueError, match="paused already"):
        llm.pause("abort")
    llm.resume()
    assert not llm.is_paused


# ---- the async engine: streams held, drained or ended while the loop thread pauses


async def _stream(engine: AsyncLLMEngine, prompt: list[int], request_id: str, seen: list) -> object:
    """Consume one request's stream; `seen` gets every output; returns the last."""
    async for out in engine.generate(prompt, PARAMS, request_id):
        seen.append(out)
    return seen[-1]


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.fixture
def async_engine(checkpoints):
    engine = AsyncLLMEngine(EngineConfig(model=str(checkpoints[0]), **ENGINE_ARGS))
    yield engine
    engine.shutdown()


def _tokens(seen: list) -> int:
    return len(seen[-1].outputs[0].token_ids) if seen else 0


async def test_async_keep_holds_streams_across_an_update(async_engine, checkpoints, refs):
    old, new = checkpoints
    seen = [[], []]
    tasks = [asyncio.create_task(_stream(async_engine, p, f"a{i}", seen[i])) for i, p in enumerate(PROMPTS)]
    await _until(lambda: all(_tokens(s) >= 2 for s in seen))
    await async_engine.pause("keep")
    assert async_engine.is_paused
    late_seen: list = []
    late = asyncio.create_task(_stream(async_engine, PROMPTS[0], "late", late_seen))
    counts = [_tokens(s) for s in seen]
    await asyncio.sleep(0.3)
    assert [_tokens(s) for s in seen] == counts and not late_seen and not any(t.done() for t in tasks)
    assert await async_engine.update_weights_from_disk(str(new)) == 1
    await async_engine.resume()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for i, o in enumerate(finals):
        (v0, s0), (v1, k) = o.outputs[0].weight_versions
        assert (v0, s0, v1) == (0, 0, 1) and 2 <= k < MAX_TOKENS and o.weight_versions == [0, 1]
        tokens = o.outputs[0].token_ids
        assert tokens[:k] == refs["old"][i][:k]
        assert tokens == hf_kept(old, new, PROMPTS[i], tokens[:k], MAX_TOKENS)
        # the stream's outputs before the update all came from version 0
        assert all(out.weight_version == 0 for out in seen[i] if len(out.outputs[0].token_ids) <= k)
    late_out = await asyncio.wait_for(late, 60)
    assert late_out.outputs[0].token_ids == refs["new"][0] and late_out.weight_versions == [1]


async def test_async_abort_ends_streams_and_holds_new_ones(async_engine, refs):
    seen = [[], []]
    tasks = [asyncio.create_task(_stream(async_engine, p, f"a{i}", seen[i])) for i, p in enumerate(PROMPTS)]
    await _until(lambda: all(_tokens(s) >= 2 for s in seen))
    await async_engine.pause("abort")
    finals = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for i, o in enumerate(finals):
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "abort" and len(c.token_ids) < MAX_TOKENS
        assert c.token_ids == refs["old"][i][:len(c.token_ids)]
    late_seen: list = []
    late = asyncio.create_task(_stream(async_engine, PROMPTS[1], "late", late_seen))
    await asyncio.sleep(0.3)
    assert not late.done() and not late_seen
    await async_engine.resume()
    assert (await asyncio.wait_for(late, 60)).outputs[0].token_ids == refs["old"][1]


async def test_async_wait_drains_and_an_update_meanwhile_is_refused(async_engine, checkpoints, refs):
    old, new = checkpoints
    seen = [[], []]
    tasks = [asyncio.create_task(_stream(async_engine, p, f"a{i}", seen[i])) for i, p in enumerate(PROMPTS)]
    await _until(lambda: all(_tokens(s) >= 1 for s in seen))
    with pytest.raises(ValueError, match="running"):  # busy and not paused: refused, the samples go on
        await async_engine.update_weights_from_disk(str(new))
    pause = asyncio.create_task(async_engine.pause("wait"))
    late_seen: list = []
    late = asyncio.create_task(_stream(async_engine, PROMPTS[0], "late", late_seen))
    finals = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await asyncio.wait_for(pause, 30)
    assert [o.outputs[0].token_ids for o in finals] == refs["old"]
    assert all(o.outputs[0].finish_reason == "length" and o.weight_versions == [0] for o in finals)
    assert async_engine.is_paused and not late_seen
    assert await async_engine.update_weights_from_disk(str(new)) == 1
    await async_engine.resume()
    late_out = await asyncio.wait_for(late, 60)
    assert late_out.outputs[0].token_ids == refs["new"][0] and late_out.weight_versions == [1]


async def test_async_wait_holds_what_has_not_started(checkpoints, refs):
    """A request queued behind the batch with nothing computed is not drained under the old weights: it waits
    for resume and runs under the new ones, as offline."""
    old, new = checkpoints
    engine = AsyncLLMEngine(EngineConfig(model=str(old), **{**ENGINE_ARGS, "max_num_seqs": 1}))
    try:
        seen: list = [[], []]
        tasks = [asyncio.create_task(_stream(engine, p, f"a{i}", seen[i])) for i, p in enumerate(PROMPTS)]
        await _until(lambda: _tokens(seen[0]) >= 1)
        await asyncio.wait_for(engine.pause("wait"), 60)
        first = await asyncio.wait_for(tasks[0], 1)
        assert first.outputs[0].token_ids == refs["old"][0] and not seen[1] and not tasks[1].done()
        assert await engine.update_weights_from_disk(str(new)) == 1
        await engine.resume()
        queued = await asyncio.wait_for(tasks[1], 60)
        assert queued.outputs[0].token_ids == refs["new"][1] and queued.weight_versions == [1]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("level", [1, 2])
async def test_async_trainer_cycle_pause_sleep_wake_update_resume(checkpoints, refs, level):
    """A colocated trainer's step: pause (abort), sleep, (train), wake, push the new weights, resume. A request
    that arrives meanwhile waits for all of it and is served by the new weights; after a level-2 sleep the engine
    serves nothing until the update."""
    old, new = checkpoints
    engine = AsyncLLMEngine(EngineConfig(model=str(old), enable_sleep_mode=True, **ENGINE_ARGS))
    try:
        seen: list = []
        running = asyncio.create_task(_stream(engine, PROMPTS[1], "r", seen))
        await _until(lambda: _tokens(seen) >= 1)
        await engine.pause("abort")
        assert (await asyncio.wait_for(running, 30)).outputs[0].finish_reason == "abort"
        late_seen: list = []
        late = asyncio.create_task(_stream(engine, PROMPTS[0], "late", late_seen))
        await _until(lambda: engine.load()["waiting"] == 1)  # accepted while paused (asleep, it would be refused)
        await engine.sleep(level)
        assert engine.is_sleeping
        with pytest.raises(ValueError, match="asleep"):  # one that arrives now is refused (the server's 503)
            async for _ in engine.generate(PROMPTS[0], PARAMS, "while-asleep"):
                pass
        await engine.wake_up()
        assert not engine.is_sleeping
        if level == 2:  # the weights are gone: nothing is served from them
            with pytest.raises(ValueError, match="dropped by sleep"):
                async for _ in engine.generate(PROMPTS[0], PARAMS, "too-early"):
                    pass
        await asyncio.sleep(0.2)
        assert not late.done() and not late_seen
        assert await engine.update_weights_from_disk(str(new)) == 1
        await engine.resume()
        out = await asyncio.wait_for(late, 60)
        assert out.outputs[0].token_ids == refs["new"][0] and out.weight_versions == [1]
    finally:
        engine.shutdown()


# ---- over HTTP: a real `pagefleet serve --enable-rl-endpoints` on the tiny checkpoint


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("pause-http") / "server.log", "--model", str(checkpoints[0]),
               "--max-model-len", "128", "--max-num-seqs", "8", "--enable-rl-endpoints")
    yield s
    s.stop()


def _error(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


async def _sse(client: httpx.AsyncClient, body: dict, chunks: list) -> None:
    """A streamed completion: each chunk's (text, weight_version, finish_reason) into `chunks`."""
    import json

    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                c = chunk["choices"][0]
                chunks.append((c["text"], chunk["weight_version"], c["finish_reason"]))


@pytest.mark.slow
async def test_pause_routes_over_http(server, checkpoints):
    _, new = checkpoints
    body = {"model": "smol", "prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
        for bad in ({"json": {"mode": "later"}}, {"params": {"mode": "later"}}, {"json": {"mode": 3}}):
            message = _error(await client.post("/pause", **bad), "mode")
            assert all(m in message for m in ("abort", "wait", "keep")), message
        assert "not paused" in _error(await client.post("/resume"), None)
        assert (await client.get("/is_paused")).json() == {"is_paused": False}

        # ?mode=keep holds a stream; the update runs under it; its chunks say which version made them
        chunks: list = []
        stream = asyncio.create_task(_sse(client, body, chunks))
        await _until(lambda: len(chunks) >= 2)
        r = await client.post("/pause", params={"mode": "keep"})
        assert r.status_code == 200 and r.json()["is_paused"] is True, r.text
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        assert "paused already" in _error(await client.post("/pause", json={"mode": "abort"}), "mode")
        held = asyncio.create_task(client.post("/v1/completions", json={**body, "max_tokens": 4}))
        await asyncio.sleep(0.3)
        count = len(chunks)
        await asyncio.sleep(0.5)
        assert len(chunks) == count and not stream.done() and not held.done()  # nothing runs while paused
        r = await client.post("/update_weights_from_disk", json={"model_path": str(new)})
        assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
        r = await client.post("/resume")
        assert r.status_code == 200 and r.json() == {"success": True, "message": "Resumed.", "weight_version": 1,
                                                     "is_paused": False}
        await asyncio.wait_for(stream, 60)
        versions = [v for text, v, _ in chunks if text]
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert chunks[-1][2] == "length"
        out = (await asyncio.wait_for(held, 60)).json()
        assert out["weight_version"] == 1 and out["choices"][0]["finish_reason"] == "length"
        assert (await client.get("/is_paused")).json() == {"is_paused": False}

        # the body's mode: abort ends the stream in flight
        chunks = []
        stream = asyncio.create_task(_sse(client, body, chunks))
        await _until(lambda: len(chunks) >= 2)
        assert (await client.post("/pause", json={"mode": "abort"})).status_code == 200
        await asyncio.wait_for(stream, 60)
        assert chunks[-1][2] == "abort"
        assert (await client.post("/resume")).status_code == 200
