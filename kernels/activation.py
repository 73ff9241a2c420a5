"""SiLU-and-mul (the gated MLP's activation) in Triton; optionally quantised per token for the FP8 GEMM after it."""
import torch
import triton
import triton.language as tl

from .fp8 import row_scale, to_e4m3_range
from .reference import FP8_MAX


@triton.jit
def _silu_mul(row, cols, inter):
    """silu(gate) * up in fp32 for columns `cols` of one token's [gate | up] row (0 past inter)."""
    gate = tl.load(row + cols, mask=cols < inter, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=cols < inter, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    """Program (token, column tile): out = silu(gate) * up, in fp32, rounded once."""
    token, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    out = _silu_mul(x_ptr + token.to(tl.int64) * stride_xt, cols, inter)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=cols < inter)


def silu_and_mul(x):
    """x [..., 2I] -> [..., I]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    assert x2.stride(-1) == 1
    inter = shape[-1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return out.view(*shape[:-1], inter)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*shape[:-1], inter)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, inter, stride_xt, stride_qt, FP8_MAX: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Program per token: silu(gate) * up, rounded to x's dtype as silu_and_mul writes it, then quantised per
    token as fp8.quantize_fp8_per_token does. Pass 1 finds the row's max |value|, pass 2 recomputes the row
    and stores it in e4m3: the second read of gate and up comes from L2, where a bf16 output would have
    gone to memory and back."""
    token = tl.program_id(0).to(tl.int64)
    row = x_ptr + token * stride_xt
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        y = _silu_mul(row, c0 + tl.arange(0, BLOCK), inter).to(x_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = row_scale(tl.max(amax, axis=0), FP8_MAX)
    tl.store(scale_ptr + token, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        y = _silu_mul(row, cols, inter).to(x_ptr.dtype.element_ty).to(tl.float32)
        q = to_e4m3_range(y, scale, FP8_MAX)
        tl.store(q_ptr + token * stride_qt + cols, q.to(q_ptr.dtype.element_ty), mask=cols < inter)


def silu_and_mul_fp8(x):
    """x [T, 2I] -> silu_and_mul(x) quantised per token for an FP8 GEMM: (e4m3 [T, I], fp32 scale [T, 1])."""
    assert x.dim() == 2 and x.stride(-1) == 1
    inter = x.shape[-1] // 2
    q = torch.empty(x.shape[0], inter, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_and_mul_fp8_kernel[(x.shape[0],)](x, q, scale, inter, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                                BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, scale
