"""FP8 weights for Hopper: every decoder Linear becomes e4m3 weights with per-channel scales.

Prefill and other large steps quantise activations per token at run time, one `torch._scaled_mm` per GEMM
(bf16 out). Decode graphs (a few rows) read the e4m3 weight through our GEMV with the activations
unquantised: a decode step is a weight read, and FP8 halves it (ops.linear).

The embedding and lm_head stay in bf16: they are lookups or one GEMM at the end, and logits need the range.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.worker.models.layers import ops


class Fp8Linear(nn.Module):
    lora = None  # LoRA runs on bf16 / fp32 weights only (EngineConfig.validate)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.data
        if w.shape[0] % 16 or w.shape[1] % 16:
            raise ValueError(f"fp8 needs Linear sizes that are multiples of 16, got {tuple(w.shape)}")
        q, scale = ops.quantize_weight_fp8(w)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, weight_scale=self.weight_scale)


def quantize_model_fp8(model: nn.Module, device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("quantization=fp8 needs an NVIDIA GPU with FP8 tensor cores (Ada or Hopper)")
    quantize_linears_fp8(model)
    torch.cuda.empty_cache()


def quantize_linears_fp8(model: nn.Module) -> None:
    """Every decoder linear -> Fp8Linear (on any device: the CPU runs the references)."""
    for parent, name in decoder_linears(model):
        setattr(parent, name, Fp8Linear(getattr(parent, name)))
    model.fp8_weights = True


def decoder_linears(model: nn.Module):
    """(module, attribute name) of each decoder layer's qkv, o_proj, gate_up and down linears."""
    for layer in model.model.layers:
        yield from ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                    (layer.mlp, "down_proj"))
