"""FP8 GEMM steps: the norms and the activation hand the e4m3 linears rows they quantised themselves
(ops.Fp8Rows), one kernel where there were two. The model must compute exactly what quantising inside each
GEMM computed. CPU references here; tests/kernels/test_kernels_gpu.py holds the kernels to bit equality on CUDA."""

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.fp8 import quantize_linears_fp8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantised_rows_change_nothing(tiny_models, arch, monkeypatch):
    llm = LLM(str(tiny_models[arch]), max_model_len=128, num_gpu_blocks_override=32, device="cpu",
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    quantize_linears_fp8(model)
    calls = {"handed": 0, "quantised_in_gemm": 0}

    def counting(name, kind):
        real = getattr(ops.ref, name)

        def call(*args, **kwargs):
            calls[kind] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(ops.ref, name, call)

    for name in ("rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8"):
        counting(name, "handed")
    counting("fp8_linear", "quantised_in_gemm")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [list(range(100, 100 + n)) for n in (40, 7, 90)]

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], torch.tensor([[t.logprob for t in o.logprobs] for o in outs])

    fused_ids, fused_lp = run()
    fused = dict(calls)
    model.fuse_fp8_quantisation = False  # each GEMM quantises its own input, as before
    plain_ids, plain_lp = run()
    plain = {k: calls[k] - fused[k] for k in calls}
    assert fused_ids == plain_ids and torch.equal(fused_lp, plain_lp)
    # per layer and step: fused, qkv / gate_up / down read handed-over rows and only o_proj (the attention's
    # output) quantises inside its GEMM; plain, all four do
    layer_steps = fused["quantised_in_gemm"]
    assert layer_steps > 0 and fused["handed"] == 3 * layer_steps
    assert plain == {"handed": 0, "quantised_in_gemm": 4 * layer_steps}
