"""The decoder's linear layer: nn.Linear through the kernel switch, plus the step's LoRA products.

Decode-sized calls (a few token rows in a CUDA graph) go to our bandwidth-bound GEMV on CUDA (ops.linear);
the e4m3 variant is layers/fp8.py's Fp8Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.worker.models.layers import ops


class Linear(nn.Linear):
    lora = None  # LoRAWeights, attached by the LoRA manager (layers/lora.py)
    weight_scale = None  # bf16 / fp32 weights; layers/fp8.py's Fp8Linear has e4m3 ones with per-row scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)
