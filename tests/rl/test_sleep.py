"""Sleep mode on the CPU: a model moved into the weights region computes what a plain engine does (tied
embeddings included), and a level-1 sleep and wake give the same greedy tokens."""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def engines(smollm2_path):
    args = dict(max_model_len=256, max_num_seqs=4)
    return LLM(str(smollm2_path), **args), LLM(str(smollm2_path), enable_sleep_mode=True, **args)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_weights_region_holds_every_parameter_as_loaded(engines):
    plain, asleep_able = engines
    got = dict(asleep_able.engine.runner.model.named_parameters(remove_duplicate=False))
    want = dict(plain.engine.runner.model.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    m = asleep_able.engine.runner.model  # the bundled SmolLM2 ties lm_head to the embeddings
    assert m.lm_head.weight is m.model.embed_tokens.weight
    # no two parameters overlap in the region
    spans = sorted({(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in got.values()})
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_level1_sleep_and_wake_keep_greedy_tokens(engines):
    plain, llm = engines
    before = tokens(llm)
    assert before == tokens(plain)
    llm.sleep(1)
    assert llm.is_sleeping
    with pytest.raises(ValueError):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping and tokens(llm) == before
