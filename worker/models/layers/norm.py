"""RMSNorm as a layer: one kernel, fused with the residual add where the decoder has one (ops)."""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.worker.models.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False):
        """fp8: the output goes to an e4m3 GEMM; hand it over quantised (ops.Fp8Rows)."""
        if residual is None:
            return ops.rms_norm_fp8(x, self.weight, self.eps) if fp8 else ops.rms_norm(x, self.weight, self.eps)
        if fp8:
            return ops.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
