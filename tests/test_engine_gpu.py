"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers in fp32; skipped without a GPU.

benchmarks/gpu_bench.py runs the same comparison on 8B-shaped checkpoints; this is the small, quick one.
"""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


PROMPTS = [list(range(1000, 1000 + n)) for n in (150, 20, 300, 7)]


def chosen_logprobs(model, prompt, tokens):
    """transformers' logprob of each generated token after prompt + the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return rows.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)


def generate_mixed(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
    steps = llm.engine.recent_steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step mixed chunks and decodes"
    return outs


def transformers_pair(path):
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    return hf32, hf16


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_logprobs_match_transformers_with_chunks_mixed_into_decodes(tiny_models, arch, enforce_eager):
    path = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=32, max_num_seqs=8,
              enforce_eager=enforce_eager, gpu_memory_fraction=0.2)
    outs = generate_mixed(llm)
    hf32, hf16 = transformers_pair(path)
    for p, out in zip(PROMPTS, outs):
        toks = out.outputs[0].token_ids
        ref = chosen_logprobs(hf32, p, toks)
        hf_bf16_error = (chosen_logprobs(hf16, p, toks) - ref).abs().max().item()
        ours = torch.tensor([e.logprob for e in out.outputs[0].logprobs], device="cuda")
        # "within bf16 tolerance": no worse than twice what transformers itself loses in bf16
        assert (ours - ref).abs().max().item() <= max(2 * hf_bf16_error, 0.05)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_logprobs_near_transformers(tiny_models, arch):
    """--quantization fp8 with graphs: prompt chunks through torch._scaled_mm, decode graphs through the
    e4m3 GEMV, norms folded before quantising. e4m3 keeps 3 mantissa bits to bf16's 7, so the bound is
    16x what transformers loses in bf16 (mean over all tokens), and at least 0.1."""
    from pagefleet.worker.fp8 import Fp8Linear

    path = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", quantization="fp8", max_model_len=512, max_num_batched_tokens=32,
              max_num_seqs=8, gpu_memory_fraction=0.2)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.model.norms_folded
    assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    outs = generate_mixed(llm)
    hf32, hf16 = transformers_pair(path)
    ours, hf_bf16, ref = [], [], []
    for p, out in zip(PROMPTS, outs):
        toks = out.outputs[0].token_ids
        ref.append(chosen_logprobs(hf32, p, toks))
        hf_bf16.append(chosen_logprobs(hf16, p, toks))
        ours.append(torch.tensor([e.logprob for e in out.outputs[0].logprobs], device="cuda"))
    ref, hf_bf16, ours = torch.cat(ref), torch.cat(hf_bf16), torch.cat(ours)
    error, hf_error = (ours - ref).abs().mean().item(), (hf_bf16 - ref).abs().mean().item()
    assert error <= max(16 * hf_error, 0.1), (error, hf_error)
