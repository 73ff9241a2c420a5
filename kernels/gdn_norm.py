"""The Gated DeltaNet output norm in Triton: rms_norm(x) * weight * silu(z) per value head, one launch.

Rounded as gdn_reference.gated_rms_norm (transformers' Qwen3_5RMSNormGated): the normalised row to the model dtype,
times the weight in the weight's and the row's promoted dtype, then times silu(z) in fp32, to the model dtype. The
torch form is about ten passes over the [T, Hv, Dv] rows; this is one.
"""
import torch
import triton
import triton.language as tl

ROWS = 16  # value-head rows a program (Dv = 128: many short rows)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, n_inner, stride_x0, stride_x1, stride_z0,
                           stride_z1, eps, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                           ROUND_WEIGHTED: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i0, i1 = (rows // n_inner).to(tl.int64), (rows % n_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(x_ptr + (i0 * stride_x0 + i1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + (i0 * stride_z0 + i1 * stride_z1)[:, None] + cols[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    h = x.to(tl.float32)
    h = (h * tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    h = w[None, :] * h
    if ROUND_WEIGHTED:  # weight and rows of one dtype: torch rounds their product to it
        h = h.to(dtype).to(tl.float32)
    zf = z.to(tl.float32)
    y = h * (zf * tl.sigmoid(zf))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(dtype), mask=mask)


def _rows(t):
    """(tensor, inner count, stride0, stride1) for [T, H, D] or [T, D] rows with a unit last stride."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    if t.dim() != 3:
        t = t.reshape(-1, t.shape[-1])
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def gated_rms_norm(x, z, weight, eps=1e-6):
    """x, z [..., Dv] (z may be a strided view of the in-projection) -> [..., Dv] in x.dtype."""
    if x.shape != z.shape or weight.shape != (x.shape[-1],):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xr, n_inner, sx0, sx1 = _rows(x)
    zr, z_inner, sz0, sz1 = _rows(z)
    if z_inner != n_inner:  # one of them came flattened: flatten both
        xr, zr = x.reshape(-1, x.shape[-1]).contiguous(), z.reshape(-1, z.shape[-1]).contiguous()
        n_inner, sx0, sx1, sz0, sz1 = 1, xr.stride(0), 0, zr.stride(0), 0
    n_rows = x.numel() // x.shape[-1]
    if n_rows == 0:
        return out
    N = x.shape[-1]
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, ROWS),)](
        xr, zr, weight, out, n_rows, n_inner, sx0, sx1, sz0, sz1, eps, N=N, BLOCK=triton.next_power_of_2(N),
        ROWS=ROWS, ROUND_WEIGHTED=weight.dtype == x.dtype, num_warps=4)
    return out
