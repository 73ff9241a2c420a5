"""FP8 GEMM for decode batches past 32 rows: y = (xq * x_scale) @ (W_e4m3 * w_scale)^T on fp8 tensor cores.

Past 32 rows the weight-only GEMV (gemv.py) runs out of arithmetic, and torch._scaled_mm reads the e4m3
weight far below the memory's bandwidth (the 8B shape's 32 layers of linears: 3,796 us at 64 rows on the
H200, ~1.8 TB/s), though a decode step of 64 rows is still a weight read. This kernel takes them in
3,280 us against _scaled_mm's 3,759 on an H100 (benchmarks/fp8_skinny_bench.py); ops.linear routes 33..64
rows here. The rows arrive quantised per token (ops.Fp8Rows, from the norm or the activation before the
linear; o_proj's input is quantised first), so the dot runs on e4m3 on both sides: no conversion in
registers, both tiles straight from shared memory into wgmma's fp8 form.

The product is computed transposed, acc[BLOCK_N, BLOCK_M] = W_tile @ xq_tile^T: the weight rows fill the
dot's M side (64 or 128 a program) whatever the batch, and both operands stay K-major as fp8 wgmma needs.
Each program streams its BLOCK_N weight rows once; the rows of x (at most 128) are re-read from L2. Row and
column indices past M and N wrap around (m % M, n % N), so no load is predicated and the stores are masked.
Split K merges through the arrival counters (arrivals.py) as the GEMV does: each slice stores its fp32
partial, and the last slice of a column tile to arrive sums them in slice order, so results are
deterministic and a linear stays one launch with no host sync (CUDA graphs capture it). The per-token and
per-channel scales and the bias apply once, after the sum.
"""
import warnings

import torch
import triton
import triton.language as tl

from .arrivals import counters
from .gemv_tiles import sm_count

MAX_ROWS = 128  # one program holds every row


@triton.jit
def _finish(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """The scales (sum_k xq_mk * q_nk * sx_m * sw_n), the bias and the masked, transposed store."""
    acc = acc * tl.load(ws_ptr + offs_n % N)[:, None] * tl.load(xs_ptr + offs_m % M)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n % N).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "split_k"])  # batches up to BLOCK_M rows share one compile
def _fp8_skinny_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, counts_ptr, M, N, K, k_per_split,
                       split_k, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """Program (column tile, K slice). SPLIT: the slice stores its partial at part_ptr [split_k, M, N]; the last
    to arrive at its tile's counter sums all of them in slice order, finishes, and sets the counter back to 0.
    K and k_per_split are multiples of BLOCK_K (the wrapper sees to it)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # int64: a large weight's offsets pass 2**31.
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
    x_rows = (offs_m % M).to(tl.int64) * stride_xm
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :])
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :])
        if UPCAST:  # the interpreter: the same products in fp32 (every e4m3 value is exact there)
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if SPLIT:
        cols = offs_m[None, :] * N + offs_n[:, None]
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tl.store(part_ptr + pid_k * M * N + cols, acc, mask=mask)
        # The partial stores come before the release; the last arrival's acquire makes every slice's visible.
        tl.debug_barrier()
        if tl.atomic_add(counts_ptr + pid_n, 1, sem="acq_rel") == split_k - 1:
            tl.store(counts_ptr + pid_n, 0)  # back to 0 for the next launch
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(split_k):
                acc += tl.load(part_ptr + s * M * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)
    else:
        _finish(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


def block_m(M: int) -> int:
    """The rows one program holds: M padded to a power of two, at least the dot's 16."""
    return max(16, triton.next_power_of_2(M))


def default_config(M: int, N: int, K: int, num_sms: int = 132) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages, split_k) for xq [M, K] @ weight [N, K].T.

    From the sweep at 64 rows (benchmarks/fp8_skinny_bench.py, H100): 64 weight rows a program (one
    warpgroup's wgmma side), 4 warps; 256-wide K tiles for down's long rows, 128 elsewhere; K split in two
    where the column tiles alone leave half the SMs idle (o_proj and down: 64 tiles), 4 stages."""
    block_n = 64
    grid_n = triton.cdiv(N, block_n)
    split_k = 2 if 2 * grid_n <= num_sms else 1
    return block_n, 256 if K >= 3 * N else 128, 4, 4, split_k


def fp8_skinny_gemm(xq, x_scale, weight, weight_scale, bias=None, out_dtype=torch.bfloat16, out=None, block_n=None,
                    block_k=None, num_warps=None, num_stages=None, split_k=None):
    """(xq [M, K] e4m3 * x_scale [M, 1] fp32) @ (weight [N, K] e4m3 * weight_scale [N] fp32)^T (+ bias [N])
    -> [M, N] in out_dtype; M <= MAX_ROWS, K a multiple of 32 (the fp8 dot's K step; ops.linear routes only
    such weights here).

    split_k > 1 needs the device's arrival counters (arrivals.reserve before a graph capture); without them the
    GEMM runs unsplit. Every launch parameter comes from the shapes, never from tensor values: no host sync."""
    M, K = xq.shape
    N = weight.shape[0]
    assert M <= MAX_ROWS, f"fp8_skinny_gemm holds at most {MAX_ROWS} rows, got {M}"
    assert weight.shape[1] == K and K % 32 == 0 and xq.stride(-1) == 1 and weight.stride(-1) == 1
    assert xq.dtype == weight.dtype == torch.float8_e4m3fn
    assert x_scale.dtype == weight_scale.dtype == torch.float32 and x_scale.numel() == M and x_scale.is_contiguous()
    assert weight_scale.shape == (N,) and weight_scale.is_contiguous()
    assert bias is None or (bias.shape == (N,) and bias.is_contiguous())
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device) if out is None else out
    assert out.shape == (M, N) and out.stride(-1) == 1
    if M == 0 or N == 0:
        return out
    defaults = default_config(M, N, K, sm_count(xq.device))
    block_n, block_k, num_warps, num_stages, split_k = (
        given or default for given, default in zip((block_n, block_k, num_warps, num_stages, split_k), defaults,
                                                   strict=True))
    while K % block_k:  # whole K tiles everywhere: K is a multiple of 32
        block_k //= 2
    if block_n < 16 or block_k < 32:
        raise ValueError(f"block_n={block_n}, block_k={block_k}: the fp8 dot needs 16 rows and 32 of K or more")
    k_per_split = triton.cdiv(K // block_k, split_k) * block_k  # whole tiles a slice, and no empty slice
    split_k = triton.cdiv(K, k_per_split)
    grid_n = triton.cdiv(N, block_n)
    counts = counters(xq.device, grid_n) if split_k > 1 else None
    if split_k > 1 and counts is None:  # a capture before arrivals.reserve: correct, but slower than it should be
        warnings.warn("fp8_skinny_gemm: no arrival counters for a split GEMM (a CUDA graph captured before "
                      "kernels.arrivals.reserve(device)?); running it unsplit", RuntimeWarning, stacklevel=2)
        split_k, k_per_split = 1, K
    parts = out if counts is None else torch.empty(split_k, M, N, dtype=torch.float32, device=xq.device)
    _fp8_skinny_kernel[(grid_n, split_k)](
        xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, parts,
        out if counts is None else counts, M, N, K, k_per_split, split_k, xq.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m(M), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split_k > 1, UPCAST=not xq.is_cuda, num_warps=num_warps, num_stages=num_stages)
    return out
