"""FP8 (e4m3) linear: per-token dynamic activation quantisation in Triton + torch._scaled_mm.

Weights are quantised once, per output channel (reference.quantize_weight_fp8); activations are
quantised per token at run time, so one outlier token does not crush the others' resolution.
"""
import torch
import triton
import triton.language as tl

from .reference import FP8_MAX


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr):
    """A row's e4m3 scale from its max |value| (as reference.quantize_fp8_per_token: at least 1e-12 / 448)."""
    return tl.maximum(amax, 1e-12) / FP8_MAX


@triton.jit
def to_e4m3_range(y, scale, FP8_MAX: tl.constexpr):
    """y / scale, clamped to e4m3's finite range, ready for the store's cast."""
    return tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Program per row: pass 1 finds max|x|, pass 2 writes x / scale as e4m3 (the row stays in L1/L2)."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = to_e4m3_range(x, scale, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + cols, y.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_fp8_per_token(x):
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]), x ~= q * scale."""
    M, K = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(triton.next_power_of_2(K), 4096)
        _quant_per_token_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block,
                                      num_warps=8 if block >= 2048 else 4)
    return q, scale


def fp8_linear(x, w_fp8, w_scale, bias=None, out_dtype=None):
    """y = x @ W^T, W = w_fp8 [N, K] * w_scale [N] (fp32). x [..., K]; K and N multiples of 16."""
    out_dtype = out_dtype or x.dtype
    xq, x_scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    return fp8_gemm(xq, x_scale, w_fp8, w_scale, bias, out_dtype).reshape(*x.shape[:-1], w_fp8.shape[0])


def fp8_gemm(xq, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """y = (xq * x_scale) @ W^T for rows already quantised per token (xq e4m3 [M, K], x_scale fp32 [M, 1]),
    e.g. by norm.rms_norm_fp8 or activation.silu_and_mul_fp8.

    _scaled_mm wants A row-major and B column-major: w_fp8 stored [N, K] row-major, so w_fp8.t() is.
    """
    return torch._scaled_mm(xq, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1).float(), bias=bias,
                            out_dtype=out_dtype)
