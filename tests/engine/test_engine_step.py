"""One step path: an engine that overlaps its steps gives a client exactly what a synchronous one gives, with
forked seeded samples, logprobs, a request that stops while a later step already runs over its token, and
a request that arrives mid-run."""

import pytest

from pagefleet.worker import LLM, SamplingParams

BLOCKS = 120


def run(path, async_scheduling: bool, params: dict[str, SamplingParams], late: dict[str, SamplingParams]):
    """Every request of `params` at once, those of `late` after four steps; the final outputs, and how the
    engine's steps went: launches per depth (0: read back at once, 1: overlapped), tokens dropped at resolve."""
    llm = LLM(str(path), max_model_len=256, num_gpu_blocks_override=BLOCKS, async_scheduling=async_scheduling)
    engine = llm.engine
    launches = {0: 0, 1: 0}
    dropped = []  # per resolved overlapped step: sequences that finished while it ran
    launch, resolve = engine._launch, engine._resolve

    def counting_launch(batch, prev, overlap):
        launches[int(overlap)] += 1
        return launch(batch, prev, overlap)

    def counting_resolve(step):
        if step.logprobs is None:
            dropped.append(sum(seq.is_finished for seq in step.seqs))
        return resolve(step)

    engine._launch, engine._resolve = counting_launch, counting_resolve
    engine.emit_partial = False
    prompt = {rid: list(range(40 + 9 * i, 70 + 13 * i)) for i, rid in enumerate([*params, *late])}
    for rid, p in params.items():
        engine.add_request(rid, prompt[rid], p)
    finals, steps = {}, 0
    while engine.has_unfinished_requests() or late:
        if steps == 4:
            for rid, p in late.items():
                engine.add_request(rid, prompt[rid], p)
            late = {}
        for out in engine.step():
            assert out.finished
            finals[out.request_id] = out
        steps += 1
    assert engine.pending is None and engine.block_manager.num_free_blocks == BLOCKS
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return finals, launches, sum(dropped)


def requests(stop_token: int | None):
    params = {
        "forked": SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=14, ignore_eos=True),
        "stops": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                stop_token_ids=[stop_token] if stop_token is not None else []),
        "logprobs": SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True),
        "long": SamplingParams(temperature=0.8, seed=3, max_tokens=22, ignore_eos=True),
    }
    late = {"late": SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)}
    return params, late


@pytest.fixture(scope="module")
def stop_token(tiny_models):
    """A token the `stops` request first emits as its 9th: by then its steps overlap."""
    params, late = requests(None)
    finals, _, _ = run(tiny_models["llama"], False, params, late)
    ids = finals["stops"].outputs[0].token_ids
    return next(t for i, t in enumerate(ids) if i >= 8 and t not in ids[:i])


def test_overlapped_and_synchronous_steps_give_the_same_outputs(tiny_models, stop_token):
    params, late = requests(stop_token)
    sync, sync_launches, _ = run(tiny_models["llama"], False, params, late)
    overlapped, launches, dropped = run(tiny_models["llama"], True, params, late)
    assert sync_launches[1] == 0
    assert launches[0] > 0 and launches[1] > 10, "both depths were meant to run"
    assert dropped > 0, "no token was resolved for a sequence that had stopped meanwhile"
    assert sync.keys() == overlapped.keys() == {*params, *late}
    for rid, a in sync.items():
        b = overlapped[rid]
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs], rid
        assert [(o.finish_reason, o.stop_reason) for o in a.outputs] == [(o.finish_reason, o.stop_reason)
                                                                         for o in b.outputs], rid
    assert sync["stops"].outputs[0].finish_reason == "stop" and sync["stops"].outputs[0].token_ids[-1] == stop_token
    assert len(sync["forked"].outputs) == 3 and len({tuple(o.token_ids) for o in sync["forked"].outputs}) > 1
    a, b = sync["logprobs"].outputs[0].logprobs, overlapped["logprobs"].outputs[0].logprobs
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
