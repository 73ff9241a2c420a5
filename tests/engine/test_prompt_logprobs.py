"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) against transformers' log-softmax of the same prompt, under
chunked prefill, preemption, the prefix cache, n > 1 forks and overlapped steps. The exact comparisons run on the CPU
in fp32 even where CUDA is there (a GPU serves the fp32 checkpoint in bf16); the CUDA test checks the bf16 path
beside CUDA-graphed steps within bf16's reach."""

import pytest
import torch
from test_engine_correctness import varied_prompts

from pagefleet.worker import LLM, SamplingParams

TOP = 3


def hf_prompt_logprobs(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, transformers' fp32 log-softmax at every position: [P, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def check(scored, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    """One request's RequestOutput.prompt_logprobs against the reference: [None, then entry j scoring prompt[j]]."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        e, row = scored[j], expected[j - 1]
        target = prompt[j]
        assert e.token_id == target
        assert e.logprob == pytest.approx(row[target].item(), abs=2e-4), f"position {j}"
        # 1 + the tokens more likely; a token within float noise of the target may count either way
        lp = row[target]
        assert int((row > lp + 1e-4).sum()) + 1 <= e.rank <= int((row > lp - 1e-4).sum()) + 1, f"position {j}"
        top_lp, top_ids = row.topk(k)
        assert [t for t, _ in e.top] == top_ids.tolist(), f"position {j}"
        assert [lp for _, lp in e.top] == pytest.approx(top_lp.tolist(), abs=2e-4)


@pytest.fixture(scope="module")
def llama_case(tiny_models):
    from transformers import AutoTokenizer

    path = tiny_models["llama"]
    # without the bundled tokenizer the tiny models' word-level one may leave a short prompt empty
    prompts = [p for p in varied_prompts(AutoTokenizer.from_pretrained(path)) if p]
    return path, prompts, hf_prompt_logprobs(path, prompts)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_logprobs_match_transformers_in_chunks_with_preemption(llama_case, prefix_caching):
    path, prompts, expected = llama_case
    # 16-token chunks and 20 blocks of 16: the longest prompt fits alone, not all eight at once
    llm = LLM(str(path), device="cpu", max_model_len=320, max_num_batched_tokens=16, num_gpu_blocks_override=20,
              enable_prefix_caching=prefix_caching)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tops = [TOP if i % 2 else 1 for i in range(len(prompts))]  # steps that score for several k at once
    scored = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in tops]
    # every prompt twice, once with prompt logprobs: the second asks after the first cached its blocks
    outs = llm.generate(prompts + prompts, [plain] * len(prompts) + scored)
    assert llm.engine.stats().num_preemptions_total > 0, "the KV budget was meant to force preemption"
    for i, prompt in enumerate(prompts):
        assert outs[i].prompt_logprobs is None
        check(outs[len(prompts) + i].prompt_logprobs, prompt, expected[i], tops[i])
        # scoring the prompt does not change what is generated
        assert outs[len(prompts) + i].outputs[0].token_ids == outs[i].outputs[0].token_ids
    assert llm.engine.block_manager.num_free_blocks == 20


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_prompt_logprobs_of_other_architectures(tiny_models, arch):
    from transformers import AutoTokenizer

    path = tiny_models[arch]
    prompts = [p for p in varied_prompts(AutoTokenizer.from_pretrained(path)) if p][:5]
    expected = hf_prompt_logprobs(path, prompts)
    llm = LLM(str(path), device="cpu", max_model_len=320, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    for out, prompt, e in zip(outs, prompts, expected, strict=True):
        check(out.prompt_logprobs, prompt, e, 1)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_with_forked_samples_and_only_the_own_token(llama_case, async_scheduling):
    path, prompts, expected = llama_case
    llm = LLM(str(path), device="cpu", max_model_len=320, max_num_batched_tokens=48,
              async_scheduling=async_scheduling)
    params = [SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=5, prompt_logprobs=0),
              SamplingParams(temperature=1.0, seed=7, max_tokens=5)]
    forked, alone = llm.generate([prompts[4], prompts[4]], params)
    assert alone.prompt_logprobs is None
    check(forked.prompt_logprobs, prompts[4], expected[4], 0)  # 0: the prompt token's own logprob and rank only
    # the four samples are the four seeded samples they would be without prompt logprobs
    assert forked.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in forked.outputs}) > 1


def test_prompt_logprobs_are_validated():
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs") as err:
            SamplingParams(prompt_logprobs=bad).validate()
        assert err.value.param == "prompt_logprobs"
    SamplingParams(prompt_logprobs=20).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_on_cuda_beside_graphed_steps(llama_case):
    """On the GPU (bf16, CUDA graphs on) a scored prompt's steps run eagerly beside graphed ones: its prompt
    logprobs stay within bf16's reach of transformers' fp32 ones, and the plain requests' outputs are untouched."""
    path, prompts, expected = llama_case
    llm = LLM(str(path), max_model_len=320, max_num_batched_tokens=64)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    alone = llm.generate(prompts, plain)
    mixed = llm.generate(prompts + prompts, [plain] * len(prompts) + [scored] * len(prompts))
    for i, prompt in enumerate(prompts):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
        out = mixed[len(prompts) + i].prompt_logprobs
        assert len(out) == len(prompt) and out[0] is None
        if len(prompt) == 1:  # nothing before its only token: nothing to score
            continue
        got = torch.tensor([e.logprob for e in out[1:]])
        want = expected[i][torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        assert (got - want).abs().mean() < 0.05, (got - want).abs().max()
        assert [e.token_id for e in out[1:]] == prompt[1:]
        top1 = sum(e.top[0][0] == expected[i][j].argmax().item() for j, e in enumerate(out[1:]))
        assert top1 >= 0.9 * (len(prompt) - 1)
