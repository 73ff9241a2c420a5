"""Bad input gets a clear error naming the problem, and leaves the engine serving."""

import json

import pytest

from pagefleet.worker import LLM, EngineConfig, SamplingParams
from pagefleet.worker.models.loader import ModelFolderError


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"]), max_model_len=64, num_gpu_blocks_override=32)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "the prompt is empty"),
        (list(range(100, 170)), SamplingParams(), "the prompt has 70 tokens but max_model_len is 64"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        ([5, 6], SamplingParams(max_tokens=-3), "max_tokens must be a positive integer"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        ([5, 6], SamplingParams(temperature=-1), "temperature must be >= 0"),
        ([5, 6], SamplingParams(n=0), "n must be an integer in [1, 128]"),
        ([5, 6], SamplingParams(min_tokens=9, max_tokens=4), "min_tokens must be <= max_tokens"),
        ([5, 6], SamplingParams(logprobs=50), "logprobs must be in [0, 20]"),
        ([10**9], SamplingParams(), "prompt token ids must be integers in [0, 49152)"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_message(llm, prompt, params, message):
    with pytest.raises(ValueError) as err:
        llm.generate(prompt, params) if prompt else llm.engine.add_request("x", prompt, params)
    assert message in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_request_in_a_batch_adds_nothing_and_the_engine_still_serves(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_folder_without_weights_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelFolderError, match=r"missing \*\.safetensors, tokenizer\.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    import shutil

    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError) as err:
        LLM(str(folder))
    assert "unsupported architecture ['GPT2LMHeadModel']" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def test_kv_budget_too_small_for_one_sequence_fails_at_start_with_numbers(tiny_models):
    with pytest.raises(ValueError) as err:
        LLM(str(tiny_models["llama"]), max_model_len=512, kv_cache_memory_bytes=100_000)
    text = str(err.value)
    assert "cannot hold one sequence of max_model_len=512" in text and "needs 32 blocks" in text


def test_bad_engine_settings_are_refused():
    with pytest.raises(ValueError, match="gpu_memory_fraction must be in"):
        EngineConfig(gpu_memory_fraction=2).validate()
    with pytest.raises(ValueError, match="block_size must be one of"):
        EngineConfig(block_size=7).validate()
    with pytest.raises(ValueError, match="quantization must be fp8 or unset, got 'int4'"):
        EngineConfig(quantization="int4").validate()
    with pytest.raises(ValueError, match="LoRA adapters run on bf16 / fp32 weights"):
        EngineConfig(quantization="fp8", enable_lora=True).validate()


def test_fp8_without_an_fp8_gpu_fails_at_start_with_the_reason(tiny_models):
    with pytest.raises(ValueError, match="quantization=fp8 needs an NVIDIA GPU with FP8 tensor cores"):
        LLM(str(tiny_models["llama"]), max_model_len=64, num_gpu_blocks_override=16, quantization="fp8", device="cpu")
