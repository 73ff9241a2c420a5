"""Greedy outputs token-identical to transformers generate(), under chunked prefill, prefix caching and preemption."""

import pytest

from engine_models import hf_greedy
from pagefleet.worker import LLM, SamplingParams

MAX_NEW = 12


def varied_prompts(tokenizer) -> list[list[int]]:
    """8 prompts from 3 to ~300 tokens; two share a long prefix so the prefix cache has something to find."""
    base = (
        "The history of the printing press begins in the fifteenth century, when movable type changed how books were "
        "made. "
    )
    texts = [
        "Hi",
        "The capital of France is",
        "Write a short poem about the sea.",
        base * 2 + "In summary,",
        base * 6 + "The most important consequence was",
        base * 6 + "A second consequence, less often discussed, was",
        "List three prime numbers: 2, 3,",
        base * 12 + "Therefore",
    ]
    return [tokenizer(t).input_ids for t in texts]


@pytest.fixture(scope="module")
def smollm2_expected(smollm2_path):
    from transformers import AutoTokenizer

    prompts = varied_prompts(AutoTokenizer.from_pretrained(smollm2_path))
    return prompts, hf_greedy(smollm2_path, prompts, MAX_NEW)


def run_engine(path, prompts, **engine_args):
    llm = LLM(str(path), max_model_len=320, **engine_args)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW
    )  # HF min_new_tokens masks eos alike
    outs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_smollm2_matches_transformers_with_small_chunks_and_preemption(smollm2_path, smollm2_expected, prefix_caching):
    prompts, expected = smollm2_expected
    assert max(len(p) for p in prompts) > 250 and min(len(p) for p in prompts) < 5
    # 16-token chunks; 20 blocks of 16 (320 slots) hold the longest request but not all eight at once
    llm, got = run_engine(
        smollm2_path,
        prompts,
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
        num_gpu_blocks_override=20,
    )
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0, "the KV budget was meant to force preemption"
    assert max(s.num_prefill_tokens for s in stats.recent_steps) <= 16
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats.recent_steps), (
        "no step mixed a prefill chunk with decodes"
    )
    if prefix_caching:
        assert stats.prefix_cache_hits_total > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) differs from transformers"
    assert llm.engine.block_manager.num_free_blocks == 20  # nothing leaked


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tiny_models, arch):
    from transformers import AutoTokenizer

    path = tiny_models[arch]
    prompts = varied_prompts(AutoTokenizer.from_pretrained(path))
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm, got = run_engine(path, prompts, max_num_batched_tokens=16, num_gpu_blocks_override=20)
    assert llm.engine.stats().num_preemptions_total > 0
    assert got == expected
