"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers in fp32; skipped without a GPU.

benchmarks/gpu_bench.py runs the same comparison on 8B-shaped checkpoints; this is the small, quick one.
"""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_logprobs_match_transformers_with_chunks_mixed_into_decodes(tiny_models, arch, enforce_eager):
    from transformers import AutoModelForCausalLM

    path = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=32, max_num_seqs=8,
              enforce_eager=enforce_eager, gpu_memory_fraction=0.2)
    prompts = [list(range(1000, 1000 + n)) for n in (150, 20, 300, 7)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
    steps = llm.engine.recent_steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step mixed chunks and decodes"
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    def chosen_logprobs(model, p, toks):
        with torch.inference_mode():
            logits = model(torch.tensor([p + toks], device="cuda")).logits[0].float()
        rows = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + len(toks)]
        return rows.gather(1, torch.tensor(toks, device="cuda")[:, None]).squeeze(1)

    for p, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        ref = chosen_logprobs(hf32, p, toks)
        hf_bf16_error = (chosen_logprobs(hf16, p, toks) - ref).abs().max().item()
        ours = torch.tensor([e.logprob for e in out.outputs[0].logprobs], device="cuda")
        # "within bf16 tolerance": no worse than twice what transformers itself loses in bf16
        assert (ours - ref).abs().max().item() <= max(2 * hf_bf16_error, 0.05)
