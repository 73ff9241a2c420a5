"""Prompt chunks held small in the steps that decode (EngineConfig.mixed_prefill_tokens, core/scheduler.py), CPU
fp32: a step with decodes in it runs at most that many prompt tokens, a step without any runs the whole budget,
and greedy outputs stay token-identical to transformers on a tiny Llama and on a tiny hybrid Qwen3.5, whose
state snapshots fall at chunk ends."""

import argparse

import pytest

from engine_models import hf_greedy, tiny_qwen3_5
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.entrypoints.engine_args import add_engine_arguments, engine_config_from_args

MAX_NEW = 10
BUDGET, CAP = 64, 8


def prompts(vocab: int) -> list[list[int]]:
    """Seven prompts of 2 to 150 tokens, two sharing 100 (prefix hits, and a hybrid's state snapshot). None of one
    token: the step counters file a one-token prompt as a decode, where the scheduler counts it as a prompt."""
    shared = [(7 * i + 3) % (vocab - 3) + 3 for i in range(100)]
    out = [[(13 * i + 5 * n) % (vocab - 3) + 3 for i in range(n)] for n in (3, 17, 150, 40, 2)]
    return out[:3] + [shared + [11, 12, 13], shared + [21] * 30] + out[3:]


def run(path, ps, **engine_args):
    llm = LLM(str(path), device="cpu", max_model_len=320, max_num_batched_tokens=BUDGET, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)  # as HF's min_new_tokens
    outs = llm.generate(ps, params)
    return llm.engine.stats().recent_steps, [o.outputs[0].token_ids for o in outs]


def check_steps(steps) -> None:
    mixed = [s for s in steps if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed, "no step ran prompt chunks beside decodes"
    assert max(s.num_prefill_tokens for s in mixed) <= CAP
    assert max(s.num_prefill_tokens for s in steps if not s.num_decode_tokens) > CAP, \
        "a step without decodes is held to the cap"


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_prompt_chunks_beside_decodes_are_held_to_the_cap_and_tokens_match(arch, tiny_models, tmp_path):
    path = tiny_models["llama"] if arch == "llama" else tiny_qwen3_5(tmp_path / "qwen3_5")
    vocab = 512 if arch == "qwen3_5" else 49152
    ps = prompts(vocab)
    steps, got = run(path, ps, mixed_prefill_tokens=CAP)
    check_steps(steps)
    want = hf_greedy(path, ps, MAX_NEW)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i} ({len(ps[i])} tokens) differs from transformers"
    # without the cap the same load prefills in steps beside decodes past it
    steps, uncapped = run(path, ps)
    assert uncapped == got
    assert max(s.num_prefill_tokens for s in steps if s.num_decode_tokens) > CAP


def test_the_flag_reaches_the_config_and_bad_values_are_refused():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--mixed-prefill-tokens", "512"])).mixed_prefill_tokens == 512
    assert engine_config_from_args(parser.parse_args([])).mixed_prefill_tokens is None
    with pytest.raises(ValueError, match="mixed_prefill_tokens must be > 0"):
        EngineConfig(mixed_prefill_tokens=0).validate()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_one_token_prompt_chunks_beside_decodes_keep_the_tokens(arch, tiny_models, tmp_path):
    """At a cap of 1 every prompt chunk beside a decode is one token, which runs through the decode kernels (and a
    hybrid's recurrent step) as a decode row does, mid-prompt."""
    path = tiny_models["llama"] if arch == "llama" else tiny_qwen3_5(tmp_path / "qwen3_5")
    ps = prompts(512 if arch == "qwen3_5" else 49152)
    _, got = run(path, ps, mixed_prefill_tokens=1)
    assert got == hf_greedy(path, ps, MAX_NEW)
