"""`pagefleet bench throughput`'s engine run: the anchors' request draws, exact token counts, and the start-up
heap frozen for the timed run only (full GC passes over it paused the step loop for ~250 ms on the H200)."""

import argparse
import gc

import pytest

from pagefleet.worker import LLM
from pagefleet.worker.entrypoints.cli.bench_throughput import add_arguments, draw_requests, run_engine
from pagefleet.worker.executor.startup.gc_freeze import frozen_heap


def test_draws_follow_the_anchor_recipe():
    reqs = draw_requests(4, 0, (64, 1024), (32, 512), 128256)
    assert [(len(ids), out) for ids, out in reqs] == [(928, 229), (840, 487), (494, 52), (329, 293)]
    assert all(100 <= t < 120000 for ids, _ in reqs for t in ids)


def test_run_engine_counts_every_token_with_the_heap_frozen_only_while_it_runs(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    engine = llm.engine
    frozen_during_steps = []
    step = engine.step

    def recording_step():
        frozen_during_steps.append(gc.get_freeze_count())
        return step()

    engine.step = recording_step
    before = gc.get_freeze_count()
    reqs = draw_requests(6, 3, (5, 40), (2, 9), engine.model_config.vocab_size)
    result = run_engine(engine, reqs, warmup=False)
    assert result["output_tokens"] == sum(out for _, out in reqs) and result["requests"] == 6
    assert result["steps"] == len(frozen_during_steps) and min(frozen_during_steps) > before
    assert gc.get_freeze_count() == before == 0  # unfrozen afterwards: dropped engines can be collected
    assert engine.block_manager.num_free_blocks == 64


def test_frozen_heap_unfreezes_after_an_error():
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_run_static_times_only_its_own_batch(tiny_models):
    """The warm-up run of the same shapes goes untimed and uncounted; the timed run is the exact batch."""
    from pagefleet.worker.entrypoints.cli.bench_throughput import run_static

    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    added = []
    add = llm.engine.add_request

    def recording_add(request_id, ids, params, **kw):
        added.append((len(ids), params.max_tokens))
        return add(request_id, ids, params, **kw)

    llm.engine.add_request = recording_add
    result = run_static(llm.engine, 3, 20, 5)
    assert added == [(20, 2)] * 3 + [(20, 5)] * 3  # same shapes first, then the batch
    assert result["requests"] == 3 and result["output_tokens"] == 3 * 5
    assert llm.engine.block_manager.num_free_blocks == 64


def test_a_prompt_logprobs_out_of_range_is_refused_before_any_model_loads(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--prompt-logprobs", "20"]).prompt_logprobs == 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt-logprobs", "21"])
    assert "--prompt-logprobs" in capsys.readouterr().err
