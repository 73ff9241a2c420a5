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


def test_level1_sleep_and_wake_with_an_fp8_kv_cache(smollm2_path):
    """--kv-cache-dtype fp8 beside a trainer: the e4m3 cache lives in the KV region, is handed back and zeroed on
    waking like any other, and the greedy tokens after the wake are those before the sleep."""
    llm = LLM(str(smollm2_path), max_model_len=256, max_num_seqs=4, enable_sleep_mode=True, kv_cache_dtype="fp8")
    assert llm.engine.runner.kv.data.dtype == torch.float8_e4m3fn
    before = tokens(llm)
    llm.sleep(1)
    llm.wake_up()
    assert not llm.engine.runner.kv.data.view(torch.uint8).any()  # woken zeroed, before a token is written
    assert tokens(llm) == before


def test_level2_wake_and_update_restore_folded_norms(tiny_models):
    """Level 2 zeroes every parameter, the folded norms (1 since fold_norms, which bring-up runs on the GPU) too;
    the update that brings the weights back sets them to 1 again, so the greedy tokens are those before the sleep."""
    path = tiny_models["llama"]
    llm = LLM(str(path), device="cpu", max_model_len=128, num_gpu_blocks_override=32, enable_sleep_mode=True)
    with torch.no_grad():
        llm.engine.runner.model.fold_norms()
    prompts = [[5, 9, 200, 7], list(range(100, 140))]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    llm.sleep(2)
    llm.wake_up()
    norm = llm.engine.runner.model.model.layers[0].input_layernorm.weight
    assert not norm.any()  # what the wake-up mapped: zeros
    llm.update_weights_from_disk(str(path))
    assert bool((norm == 1).all())
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == before
