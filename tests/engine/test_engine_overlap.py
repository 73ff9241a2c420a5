"""Overlapped decode (step N+1 launched before step N's tokens are read) changes nothing a client sees."""

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.engine.llm_engine import PLACEHOLDER


def run(path, async_scheduling, prompts, params, partial=False, **engine_args):
    llm = LLM(
        str(path), max_model_len=256, num_gpu_blocks_override=120, async_scheduling=async_scheduling, **engine_args
    )
    engine = llm.engine
    launched = []  # per overlapped launch: did it carry prompt tokens?
    original = engine._launch

    def launch(batch, prev, overlap):
        if overlap:
            launched.append(sum(batch.num_new_tokens) > len(batch.seqs))
        return original(batch, prev, overlap)

    engine._launch = launch
    engine.emit_partial = partial
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    finals, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.num_free_blocks == 120 and engine.pending is None
    return [finals[str(i)] for i in range(len(prompts))], seen, launched


def test_overlapped_decode_gives_the_same_outputs(tiny_models):
    prompts = [list(range(100 + i, 130 + 5 * i)) for i in range(8)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=12 + 3 * i,
            stop_token_ids=[1234] if i == 3 else [],
            n=2 if i == 5 else 1,
        )
        for i in range(8)
    ]
    sync, _, none = run(tiny_models["llama"], False, prompts, params)
    overlapped, seen, launched = run(tiny_models["llama"], True, prompts, params, partial=True)
    assert not none and len(launched) > 10, "the overlapped path was not taken"
    for a, b in zip(sync, overlapped, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
    # streamed progress never shows a token that is still on the device, and only grows
    last: dict = {}
    for out in seen:
        for c in out.outputs:
            assert PLACEHOLDER not in c.token_ids
            key = (out.request_id, c.index)
            assert c.token_ids[: len(last.get(key, []))] == last.get(key, [])
            last[key] = c.token_ids


def test_overlapped_steps_with_prompt_chunks_and_a_refilling_queue(tiny_models):
    """A queue longer than the batch, prompts split into chunks, outputs of every length: steps that
    carry prompt chunks overlap too, sequences that end by length leave the batch early, and nothing
    a client sees changes."""
    prompts = [list(range(300 + 7 * i, 300 + 7 * i + 5 + (37 * i) % 90)) for i in range(14)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 else 0.7,
            seed=i,
            max_tokens=1 + (i * 5) % 17,
            ignore_eos=i % 2 == 0,
            stop_token_ids=[777] if i == 4 else [],
        )
        for i in range(14)
    ]
    engine_args = dict(max_num_seqs=4, max_num_batched_tokens=24)
    sync, _, none = run(tiny_models["llama"], False, prompts, params, **engine_args)
    overlapped, _, launched = run(tiny_models["llama"], True, prompts, params, **engine_args)
    assert not none and sum(launched) > 5, "no overlapped step carried a prompt chunk"
    for a, b in zip(sync, overlapped, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]


def test_abort_during_an_overlapped_step_frees_everything(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=120)
    engine = llm.engine
    for i in range(4):
        engine.add_request(
            f"r{i}", list(range(200, 240)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        )
    for _ in range(6):
        engine.step()
    assert engine.pending is not None
    engine.abort_request("r1")
    engine.abort_request("r2")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == 120


async def test_abort_from_outside_ends_the_stream_and_frees_blocks(tiny_models):
    import asyncio

    from pagefleet.worker.core.config import EngineConfig
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(
        EngineConfig(model=str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=64)
    )
    try:

        async def consume():
            seen = 0
            async for _ in engine.generate(list(range(100, 120)), SamplingParams(max_tokens=200, ignore_eos=True), "x"):
                seen += 1
            return seen

        task = asyncio.create_task(consume())
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.01)
        engine.abort("x")
        assert await asyncio.wait_for(task, 10) < 200  # the consumer is not left waiting
        for _ in range(200):
            if engine.load()["kv_cache_usage"] == 0.0 and engine.load()["running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.load() == {
            "waiting": 0,
            "running": 0,
            "kv_cache_usage": 0.0,
            "max_num_seqs": 256,
            "lora_adapters": {},
            "weight_version": 0,
        }
    finally:
        engine.shutdown()
