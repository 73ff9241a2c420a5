"""FP8 weights for Hopper: every decoder Linear becomes e4m3 weights with per-channel scales,
activations quantised per token at run time, one `torch._scaled_mm` per GEMM (bf16 out).

The embedding and lm_head stay in bf16: they are lookups or one GEMM at the end, and logits need the range.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet import kernels


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.data
        if w.shape[0] % 16 or w.shape[1] % 16:
            raise ValueError(f"fp8 needs Linear sizes that are multiples of 16, got {tuple(w.shape)}")
        q, scale = kernels.reference.quantize_weight_fp8(w)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.bias)


def quantize_model_fp8(model: nn.Module) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("quantization=fp8 needs an NVIDIA GPU with FP8 tensor cores (Ada or Hopper)")
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, Fp8Linear(getattr(parent, name)))
    torch.cuda.empty_cache()
