"""SiLU-and-mul (the gated MLP's activation) in Triton."""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    """Program (token, column tile): out = silu(gate) * up, in fp32, rounded once."""
    token, tile = tl.program_id(0), tl.program_id(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + token.to(tl.int64) * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


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
