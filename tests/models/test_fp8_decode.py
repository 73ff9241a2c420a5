"""Weight-only FP8 in decode steps: the e4m3 weights and their per-row scales reach every GEMV of the folded
decode path (LlamaForCausalLM.forward_folded), and the model computes what the dequantised weights compute.

On the GPU those GEMVs are kernels/gemv.py reading e4m3 (the interpreter and H200 tests check the kernel);
here the references stand in, with the folded path forced for every step of 16 rows or fewer. One-token
prompts keep every step on that path: longer prefills quantise activations for torch._scaled_mm, which the
dequantised model does not.
"""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.fp8 import Fp8Linear, decoder_linears, quantize_linears_fp8
from pagefleet.worker.models.layers.linear import Linear

PROMPTS = [[5], [200], [42]]


def generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [o.token_ids for o in outs], torch.tensor([[t.logprob for t in o.logprobs] for o in outs])


def folded_engine(path):
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=16, device="cpu")
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    model.fold_norms()  # as the GPU runner does: fold, then quantise
    return llm, model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp8_decode_path_matches_the_dequantised_model(tiny_models, arch, monkeypatch, folded_rows):
    monkeypatch.setattr(ops, "skinny_rows", lambda x, fp8=False: x.shape[0] <= ops.SKINNY_MAX_ROWS)
    monkeypatch.setattr(ops, "_skinny", lambda *args: False)  # no Triton GEMV here: lm_head stays on torch

    fp8_llm, fp8_model = folded_engine(tiny_models[arch])
    quantize_linears_fp8(fp8_model)
    assert all(isinstance(getattr(p, n), Fp8Linear) for p, n in decoder_linears(fp8_model))
    dq_llm, dq_model = folded_engine(tiny_models[arch])
    with torch.no_grad():  # the same model with each e4m3 weight times its scale, in fp32
        for (p, n), (fp, fn) in zip(decoder_linears(dq_model), decoder_linears(fp8_model), strict=True):
            q = getattr(fp, fn)
            getattr(p, n).weight.copy_(q.weight.float() * q.weight_scale[:, None])
            assert isinstance(getattr(p, n), Linear) and getattr(p, n).weight_scale is None

    tokens, logprobs = generate(fp8_llm)
    # every step folded
    assert folded_rows and max(folded_rows) <= ops.SKINNY_MAX_ROWS and sum(folded_rows) == 8 * len(PROMPTS)
    dq_tokens, dq_logprobs = generate(dq_llm)
    assert tokens == dq_tokens
    assert torch.allclose(logprobs, dq_logprobs, atol=1e-4), (logprobs - dq_logprobs).abs().max()
