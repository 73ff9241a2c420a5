"""Sampling through the engine on CPU: a seeded request's tokens do not depend on the batch beside it or on
async scheduling; sample i of an n = 4 request equals an n = 1 request seeded seed + i; penalised and
logprobs steps overlap and give what synchronous steps give; unseeded runs repeat under the engine's seed."""

import pytest

from pagefleet.worker import LLM, SamplingParams

PROMPT = list(range(300, 331))
TARGET = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, frequency_penalty=0.3,
                        repetition_penalty=1.1, seed=1234, max_tokens=12, ignore_eos=True)
OTHERS = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.7, presence_penalty=0.5, seed=9, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.2, n=2, seed=5, max_tokens=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def engines(tiny_models):
    return {a: LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=200, async_scheduling=a)
            for a in (False, True)}


def count_launches(llm):
    launches = {0: 0, 1: 0}
    launch = llm.engine._launch

    def counting(batch, prev, overlap):
        launches[int(overlap)] += 1
        return launch(batch, prev, overlap)

    llm.engine._launch = counting
    return launches


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_seeded_request_ignores_its_batch_and_the_scheduling(engines, async_scheduling):
    alone = engines[False].generate(PROMPT, TARGET)[0].outputs[0].token_ids
    assert len(alone) == 12
    llm = engines[async_scheduling]
    for k in range(1, len(OTHERS) + 1):
        prompts = [list(range(500 + 7 * i, 520 + 9 * i)) for i in range(k)] + [PROMPT]
        outs = llm.generate(prompts, OTHERS[:k] + [TARGET])
        assert outs[-1].outputs[0].token_ids == alone, k


def test_sample_i_of_n_equals_its_n1_twin_seeded_seed_plus_i(engines):
    params = dict(temperature=1.0, top_p=0.95, presence_penalty=0.4, max_tokens=10, ignore_eos=True)
    group = engines[True].generate(PROMPT, SamplingParams(n=4, seed=77, **params))[0]
    assert [o.index for o in group.outputs] == [0, 1, 2, 3]
    for i, out in enumerate(group.outputs):
        twin = engines[True].generate(PROMPT, SamplingParams(seed=77 + i, **params))[0].outputs[0]
        assert out.token_ids == twin.token_ids, i
    assert len({tuple(o.token_ids) for o in group.outputs}) > 1


def test_penalties_and_logprobs_overlap_and_match_synchronous_steps(engines):
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=i, max_tokens=14, ignore_eos=True,
                             logprobs=3 if i % 2 else None, min_tokens=4, logit_bias={7: 3.0})
              for i in range(4)]
    prompts = [list(range(100 + i, 140 + 3 * i)) for i in range(4)]
    launches = count_launches(engines[True])
    overlapped = engines[True].generate(prompts, params)
    sync = engines[False].generate(prompts, params)
    assert launches[1] > 10, launches
    for a, b in zip(sync, overlapped, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert p.token_id == q.token_id and p.logprob == pytest.approx(q.logprob, abs=1e-5)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]


def test_unseeded_sampling_repeats_under_the_engine_seed(tiny_models):
    params = SamplingParams(temperature=1.0, n=3, max_tokens=8, ignore_eos=True)

    def run(seed):
        llm = LLM(str(tiny_models["llama"]), max_model_len=128, num_gpu_blocks_override=60, seed=seed)
        return [o.token_ids for o in llm.generate(PROMPT, params)[0].outputs]

    first = run(0)
    assert run(0) == first and run(1) != first
