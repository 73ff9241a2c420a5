"""Decoder norms folded into the linears after them (LlamaForCausalLM.fold_norms) compute the same model.

On the GPU the decode graphs then run LlamaForCausalLM.forward_folded, which launches no per-layer norm.
Here, on the CPU, that path is forced for every step of 16 rows or fewer (the references stand in for our
GEMV), and prompt steps take the ordinary path through the folded weights.
"""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.models.layers import ops


def generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [o.token_ids for o in outs], torch.tensor([[t.logprob for t in o.logprobs] for o in outs])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_folded_norms_give_the_same_tokens_and_logprobs(tiny_models, arch, monkeypatch, folded_rows):
    # on the CPU even where there is a GPU: the GPU engine folds at load, and its graphs are captured by then
    llm = LLM(str(tiny_models[arch]), max_model_len=128, num_gpu_blocks_override=32, device="cpu")
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # transformers initialises norm weights to 1, which folding would not notice
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    prompts = [[5, 9, 200, 7], list(range(100, 140)), [42] * 20]
    tokens, logprobs = generate(llm, prompts)

    model.fold_norms()
    assert all(bool((layer.input_layernorm.weight == 1).all()) for layer in model.model.layers)
    monkeypatch.setattr(ops, "_skinny", lambda *args: False)  # ordinary linears stay on torch here
    monkeypatch.setattr(ops, "skinny_rows", lambda x, fp8=False: x.shape[0] <= ops.SKINNY_MAX_ROWS)
    folded_tokens, folded_logprobs = generate(llm, prompts)
    assert folded_rows and max(folded_rows) <= ops.SKINNY_MAX_ROWS  # the decode steps took the folded path
    assert folded_tokens == tokens
    assert torch.allclose(folded_logprobs, logprobs, atol=1e-4), (folded_logprobs - logprobs).abs().max()
