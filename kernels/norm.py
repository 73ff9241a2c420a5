"""RMSNorm (plain and with the residual add fused) in Triton, numerically like HF's LlamaRMSNorm; optionally
quantised per token for the FP8 GEMM that reads it. And the embeddings of a folded decode step with the sums
of squares its first GEMV normalises them by."""
import torch
import triton
import triton.language as tl

from .fp8 import row_scale, to_e4m3_range
from .reference import FP8_MAX


@triton.jit(do_not_specialize=["n_rows"])  # token counts vary every step
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, n_rows, n_inner, stride_x0, stride_x1,
                     stride_r0, stride_r1, eps, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """ROWS rows per program (many short rows, e.g. per-head q/k norm, would starve one-row programs).

    Rows are indexed by two leading dims, so a strided [T, H, D] view of a fused qkv needs no copy.
    FP8: out is e4m3 with one scale per row, the next GEMM's per-token quantisation of the rounded output
    (as fp8.quantize_fp8_per_token would do it), so the normalised rows never go through memory in bf16.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i0, i1 = (rows // n_inner).to(tl.int64), (rows % n_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(x_ptr + (i0 * stride_x0 + i1 * stride_x1)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + (i0 * stride_r0 + i1 * stride_r1)[:, None] + cols[None, :], mask=mask, other=0.0)
        # HF adds in the model dtype: round the sum before normalising it.
        s = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=1) / N
    dtype = x_ptr.dtype.element_ty  # the output's dtype (before any FP8 quantisation)
    h = (x * tl.rsqrt(var + eps)[:, None]).to(dtype).to(tl.float32)  # HF: .to(input_dtype) first
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (w[None, :] * h).to(dtype)
    if FP8:
        y = y.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=1), FP8_MAX)  # padding lanes and rows hold 0
        q = to_e4m3_range(y, scale[:, None], FP8_MAX)
        tl.store(out_ptr + out_offs, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=rows < n_rows)
    else:
        tl.store(out_ptr + out_offs, y, mask=mask)


def _rows(t):
    """(tensor, inner count, stride0, stride1): rows addressed by up to two leading dims, no copy if avoidable."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() > 3 or t.stride(-1) != 1:
        t = t.reshape(-1, t.shape[-1])
        t = t if t.stride(-1) == 1 else t.contiguous()
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def _launch(x, residual, weight, eps, fp8=False):
    N = x.shape[-1]
    if residual is None:
        xr, n_inner, sx0, sx1 = _rows(x)
        rr, sr0, sr1 = xr, 0, 0
    else:  # the fused form runs on hidden states [T, hidden]: plain rows
        xr, _, sx0, sx1 = _rows(x.reshape(-1, N))
        rr, _, sr0, sr1 = _rows(residual.reshape(-1, N))
        n_inner = 1
    rows = xr.numel() // N
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if fp8 else None
    if rows:
        block = triton.next_power_of_2(N)
        rows_per_prog = max(1, min(32, 4096 // block))  # ~4096 elements a program
        _rms_norm_kernel[(triton.cdiv(rows, rows_per_prog),)](
            xr, rr, weight, out, res_out, scale if fp8 else out, rows, n_inner, sx0, sx1, sr0, sr1, eps, N=N,
            BLOCK=block, ROWS=rows_per_prog, ADD_RESIDUAL=residual is not None, FP8=fp8, FP8_MAX=FP8_MAX,
            num_warps=min(max(block * rows_per_prog // 256, 1), 16))
    return (out.view(-1, N), scale) if fp8 else out, res_out


def rms_norm(x, weight, eps=1e-6):
    """x [..., D] (any leading shape, e.g. Qwen3's per-head q/k norm on [T, H, D]) -> normalised copy."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """-> (rms_norm(x + residual), x + residual), in one pass over memory."""
    return _launch(x, residual, weight, eps)


def rms_norm_fp8(x, weight, eps=1e-6):
    """x [T, D] -> rms_norm(x) quantised per token for an FP8 GEMM: (e4m3 [T, D], fp32 scale [T, 1])."""
    return _launch(x, None, weight, eps, fp8=True)[0]


def fused_add_rms_norm_fp8(x, residual, weight, eps=1e-6):
    """-> (e4m3 rows, scales [T, 1], x + residual): fused_add_rms_norm with its output quantised per token."""
    (q, scale), res_out = _launch(x, residual, weight, eps, fp8=True)
    return q, scale, res_out


@triton.jit
def _embed_rows_kernel(ids_ptr, table_ptr, out_ptr, sumsq_ptr, stride_t, N: tl.constexpr, BLOCK: tl.constexpr):
    """Program m: out[m] = table[ids[m]], and sumsq[m] its fp32 sum of squares."""
    m = tl.program_id(0)
    row = tl.load(ids_ptr + m).to(tl.int64)  # vocab x hidden can pass 2**31 elements
    cols = tl.arange(0, BLOCK)
    x = tl.load(table_ptr + row * stride_t + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + m * N + cols, x, mask=cols < N)
    x = x.to(tl.float32)
    tl.store(sumsq_ptr + m, tl.sum(x * x, axis=0))


def embed_rows(ids, table):
    """ids [M] -> (table[ids] [M, K], sums of squares [1, M] fp32) in one launch. The torch way, an embedding
    then .float().square().sum(), is 4 launches and ~25 us of a batch-16 decode step; this saves 8-23 us a
    step (H200, 8B shape, benchmarks/decode_graphs_ab.py's torch_embed arm in commit 0f81933)."""
    M, N = ids.shape[0], table.shape[1]
    assert table.stride(1) == 1
    out = torch.empty(M, N, dtype=table.dtype, device=table.device)
    sumsq = torch.empty(1, M, dtype=torch.float32, device=table.device)
    if M:
        block = triton.next_power_of_2(N)
        _embed_rows_kernel[(M,)](ids, table, out, sumsq, table.stride(0), N=N, BLOCK=block,
                                 num_warps=min(16, max(4, block // 1024)))
    return out, sumsq
