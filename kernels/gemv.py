"""Skinny matmul for decode-time linears (M <= 16 token rows): out = x @ weight.T + bias at memory bandwidth.

At decode a linear layer's cost is reading its weight once; the arithmetic is nearly free. Each program
owns BLOCK_N output channels and streams their weight rows in [BLOCK_N, BLOCK_K] tiles, multiplying each
tile by the matching slice of all M rows of x, so the weight is read exactly once. Many small programs
fill the GPU; where the row tiles are too few (FP8 weights, or down_proj's long rows), K is split too,
and the last slice of a tile to finish merges the others' partials, so a linear stays one launch.

One path for every M: tl.dot with M padded to 16 rows (M_PAD). The tensor cores' wasted rows cost nothing
here, and the dot lets Triton pipeline the weight loads (cp.async, num_stages); the usual M = 1 form
(broadcast multiply, tl.sum) got no pipelining and measured no faster on the H200 even at its best tile
(Llama-3.1-8B's linears at M = 1: 3805 us a decode step swept, against 3786 for the dot).

H200, CUDA graph, 32 distinct weights per shape (benchmarks/gemv_bench.py): with the defaults, one decode
step's linears at M = 1 took 3790 us against cuBLAS's 3931; lm_head read 4.53 TB/s (cuBLAS 4.38), and every
shape and M in 1..16 was within 1% of cuBLAS or faster (o_proj 11.4 us against 13.6).

gated=True folds the gated MLP's silu(gate) * up into the gate_up GEMV's epilogue: one launch and one
[M, 2I] round trip fewer per layer (H200, 8B shape, same process: decode step at batch 1 4.67 -> 4.54 ms).
sumsq= and residual= let a decode layer run with no RMSNorm launch (LlamaForCausalLM.forward_folded):
4.327 -> 4.275 ms at batch 1.
"""
import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from . import pdl
from .arrivals import counters
from .gemv_tiles import default_config, sm_count


@triton.jit
def _tile(acc, x_ptr, w_ptr, x_rows, m_mask, w_rows, k0, k_stop, BLOCK_K: tl.constexpr, MASK: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_FP8: tl.constexpr, rstd, NORM_X: tl.constexpr):
    """acc += x[:, k0:k0+BLOCK_K] @ weight[rows, k0:k0+BLOCK_K].T; MASK only on a split's K tail.
    NORM_X: x's rows are scaled by rstd [M_PAD] first (an FP8 GEMV reading a folded norm's input)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if MASK:
        k_mask = offs_k[None, :] < k_stop
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=k_mask, other=0.0)
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
    else:  # no predicate on the weight: its loads stay 16 bytes wide
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :])
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    if UPCAST:  # the interpreter mishandles half-precision arithmetic
        w, x = w.to(tl.float32), x.to(tl.float32)
        if NORM_X:
            x = x * rstd[:, None]
    elif W_FP8:
        # Weight-only FP8, the dot in fp16: e4m3 -> fp16 is exact and one instruction a pair (to bf16 it
        # is not: gate_up's GEMV took 45 us against 35), and bf16 -> fp16 is exact within fp16's range.
        # A folded norm's input (the residual stream, where outliers live) is normalised first, so its
        # values are at most sqrt(K) and cannot overflow; clamping every x instead cost 0.57 ms a step.
        w = w.to(tl.float16)
        if NORM_X:
            x = (x.to(tl.float32) * rstd[:, None]).to(tl.float16)
        else:
            x = x.to(tl.float16)
    return tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, res_ptr, sumsq_out_ptr, partials, offs_m, offs_n, m_mask,
              n_mask, M, N, K, eps, pid_n, stride_om, stride_rm, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
              RMS_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, W_FP8: tl.constexpr, NORM_X: tl.constexpr):
    """The whole sum's finish: FP8 row scales, a folded norm's rstd, bias, silu(gate) * up, the residual add
    with its sums of squares, and the store."""
    if W_FP8:  # sum(x_k * q_nk * s_n) = s_n * sum(x_k * q_nk)
        acc *= tl.load(scale_ptr + offs_n % N)[None, :]
        if GATED:
            acc_up *= tl.load(scale_ptr + N + offs_n % N)[None, :]
    if RMS_IN and not NORM_X:  # sum(x_k * rstd * g_k * w_nk) = rstd * sum(x_k * (g_k * w_nk)): one multiply
        rstd = tl.rsqrt(tl.sum(partials, axis=0) / K + eps)
        acc *= rstd[:, None]
        if GATED:
            acc_up *= rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:  # as the unfused path: both products rounded to the model dtype, then silu(gate) * up in fp32
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:  # as HF: the product rounded to the model dtype, then the sum rounded
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask, other=0.0)
        acc = (acc.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
        acc = tl.where(out_mask, acc.to(tl.float32), 0.0)
        tl.store(sumsq_out_ptr + pid_n * M + offs_m, tl.sum(acc * acc, axis=1), mask=m_mask)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "n_sumsq", "split_k"])  # batch sizes up to M_PAD share one compile
def _skinny_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sumsq_ptr, res_ptr, sumsq_out_ptr, part_ptr, counts_ptr,
                   M, N, K, k_per_split, split_k, stride_xm, stride_wn, stride_om, stride_rm, n_sumsq, eps,
                   HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GATED: tl.constexpr, RMS_IN: tl.constexpr, SUMSQ_PAD: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_FP8: tl.constexpr, NORM_X: tl.constexpr,
                   SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Program (n tile, k split): out rows of this n tile = x @ weight[n tile].T (+ bias), over one K slice.

    GATED: weight packs [gate; up] (2N rows) and out = silu(x @ gate.T) * (x @ up.T), [M, N]: the program
    reads the matching gate and up rows, so the gated MLP's activation needs no launch of its own.
    RMS_IN: x is an RMSNorm's input (the norm's weight folded into this weight's columns) and each row of
    the product is scaled by rsqrt(mean(x_row**2) + eps), from the n_sumsq partial sums of squares [n, M]
    that the GEMV which wrote x left behind.
    ADD_RESIDUAL: out = residual + product (rounded as HF adds), and this program stores its columns' sums of
    squares of each out row at sumsq_out[pid_n, :], for the RMS_IN GEMV that reads out next.
    W_FP8: the weight is e4m3 with one fp32 scale per row (scale_ptr, [2N] when GATED): half the bytes to read.
    NORM_X (W_FP8 with RMS_IN): rstd is applied to x's tiles before the dot rather than to the product after.
    SPLIT: each of the split_k programs of an n tile stores its fp32 partial (part_ptr, [split_k, M, N or 2N]);
    the last to arrive (counts_ptr, one counter per n tile) sums them in split order and finishes, so a
    split GEMV is still one launch and its result does not depend on which split finished last.
    PDL: launched with programmatic dependent launch (kernels/pdl.py): wait for the kernel ahead first.
    """
    if PDL:
        tl_cuda.gdc_wait()
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    # Rows past N re-read row n % N: every weight load is in bounds without a mask, and those rows are
    # never stored. int64: vocab x hidden can pass 2**31 elements.
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
    # Padded x rows are masked off, not clamped to a real row: every program re-reads its x slice from L2
    # each tile (at BLOCK_N = 16 as many bytes as the weight tile), and clamped rows all hit the same few
    # L2 lines (M = 2 ran 2x slower than M = 16 that way).
    m_mask = offs_m < M
    x_rows = offs_m * stride_xm
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    k_full = k_start + (k_stop - k_start) // BLOCK_K * BLOCK_K
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = acc
    n_mask = offs_n < N
    rstd = tl.full([M_PAD], 1.0, dtype=tl.float32)
    partials = rstd[None, :]
    if RMS_IN:  # loaded before the weight stream, used after it: its latency hides behind the loop
        offs_s = tl.arange(0, SUMSQ_PAD)
        partials = tl.load(sumsq_ptr + offs_s[:, None] * M + offs_m[None, :],
                           mask=(offs_s[:, None] < n_sumsq) & m_mask[None, :], other=0.0)
        if NORM_X:  # needed by the first tile
            rstd = tl.rsqrt(tl.sum(partials, axis=0) / K + eps)
    # Two loops, not one with an optional second accumulator: the plain GEMV keeps exactly the loop that
    # was measured (a restructured one, for the PDL experiment in docs/benchmarks.md, ran slower).
    if GATED:
        up_rows = w_rows + N * stride_wn
        for k0 in range(k_start, k_full, BLOCK_K):  # x's tile is re-read from L2 for the up rows
            acc = _tile(acc, x_ptr, w_ptr, x_rows, m_mask, w_rows, k0, k_stop, BLOCK_K, False, UPCAST, PRECISION,
                        W_FP8, rstd, NORM_X)
            acc_up = _tile(acc_up, x_ptr, w_ptr, x_rows, m_mask, up_rows, k0, k_stop, BLOCK_K, False, UPCAST,
                           PRECISION, W_FP8, rstd, NORM_X)
        if k_full < k_stop:
            acc = _tile(acc, x_ptr, w_ptr, x_rows, m_mask, w_rows, k_full, k_stop, BLOCK_K, True, UPCAST, PRECISION,
                        W_FP8, rstd, NORM_X)
            acc_up = _tile(acc_up, x_ptr, w_ptr, x_rows, m_mask, up_rows, k_full, k_stop, BLOCK_K, True, UPCAST,
                           PRECISION, W_FP8, rstd, NORM_X)
    else:
        for k0 in range(k_start, k_full, BLOCK_K):
            acc = _tile(acc, x_ptr, w_ptr, x_rows, m_mask, w_rows, k0, k_stop, BLOCK_K, False, UPCAST, PRECISION,
                        W_FP8, rstd, NORM_X)
        if k_full < k_stop:
            acc = _tile(acc, x_ptr, w_ptr, x_rows, m_mask, w_rows, k_full, k_stop, BLOCK_K, True, UPCAST, PRECISION,
                        W_FP8, rstd, NORM_X)
    if SPLIT:
        width = 2 * N if GATED else N
        part_mask = m_mask[:, None] & n_mask[None, :]
        cols = offs_m[:, None] * width + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * width + cols, acc, mask=part_mask)
        if GATED:
            tl.store(part_ptr + pid_k * M * width + N + cols, acc_up, mask=part_mask)
        # The partial stores come before the release; the last arrival's acquire makes every split's visible.
        tl.debug_barrier()
        if tl.atomic_add(counts_ptr + pid_n, 1, sem="acq_rel") == split_k - 1:
            tl.store(counts_ptr + pid_n, 0)  # back to 0 for the next launch
            acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            acc_up = acc
            for s in range(split_k):
                acc += tl.load(part_ptr + s * M * width + cols, mask=part_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptr + s * M * width + N + cols, mask=part_mask, other=0.0,
                                      cache_modifier=".cg")
            _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, res_ptr, sumsq_out_ptr, partials, offs_m, offs_n,
                      m_mask, n_mask, M, N, K, eps, pid_n, stride_om, stride_rm, HAS_BIAS, GATED, RMS_IN, ADD_RESIDUAL,
                      W_FP8, NORM_X)
    else:
        _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, res_ptr, sumsq_out_ptr, partials, offs_m, offs_n, m_mask,
                  n_mask, M, N, K, eps, pid_n, stride_om, stride_rm, HAS_BIAS, GATED, RMS_IN, ADD_RESIDUAL, W_FP8,
                  NORM_X)


def skinny_matmul(x, weight, bias=None, out=None, block_n=None, block_k=None, num_warps=None, num_stages=None,
                  split_k=None, gated=False, sumsq=None, eps=0.0, residual=None, weight_scale=None):
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x.dtype, fp32 accumulation.

    weight is nn.Linear's, row-major, same dtype as x; x and out need a contiguous last dim. Built for
    M <= 16 (one compile); larger M stays correct, padded to a power of two, but belongs to cuBLAS.
    split_k > 1 cuts K into that many slices, a program each: their fp32 partials go to a workspace and the
    last slice of a column tile to finish sums them in slice order (deterministic; one launch, no atomics
    on the data) and applies everything below to the whole sum. It needs the device's arrival counters
    (arrivals.reserve before a graph capture); without them the GEMV runs unsplit.
    gated=True: weight (and bias) pack [gate; up], and the result is silu(gate) * up, [M, N // 2].
    sumsq [n, M] fp32 (an RMSNorm folded in): x is the norm's input, the norm's weight is already in weight's
    columns, and sumsq holds partial sums of x's squared rows; the product is scaled by each row's rstd.
    residual [M, N]: -> (residual + product, its rows' partial sums of squares [n, M]), the sumsq of the
    next GEMV (LlamaForCausalLM.forward_folded).
    weight_scale [N] fp32 (weight-only FP8): weight is float8_e4m3fn, each row's true values are its e4m3
    values times its scale. x is not quantised: the dot runs in fp16, which holds every e4m3 value and every
    bf16 value of magnitude 2**-14 .. 65504 exactly, so the product is a bf16 GEMV's over the dequantised
    weight, at half the bytes. With sumsq, x is normalised before the dot (at most sqrt(K) then); other
    inputs (attention outputs, the MLP's activations) must stay within fp16's range, as in an fp16 model.
    """
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == K and x.stride(-1) == 1 and weight.stride(-1) == 1
    fp8 = weight_scale is not None
    assert not fp8 or (weight.dtype == torch.float8_e4m3fn and weight_scale.dtype == torch.float32
                       and weight_scale.shape == (weight.shape[0],) and weight_scale.is_contiguous())
    assert not gated or weight.shape[0] % 2 == 0
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (M, N) and out.stride(-1) == 1
    if M == 0 or N == 0:
        return out
    defaults = default_config(M, weight.shape[0], K, sm_count(x.device), weight.element_size(), gated)
    block_n, block_k, num_warps, num_stages, split_k = (
        given or default for given, default in zip((block_n, block_k, num_warps, num_stages, split_k), defaults,
                                                   strict=True))
    if block_n < 16 or block_k < 16:
        raise ValueError(f"block_n={block_n}, block_k={block_k}: tl.dot needs 16 or more")
    # Whole BLOCK_K tiles per split, and no empty split.
    k_per_split = triton.cdiv(triton.cdiv(max(K, 1), split_k), block_k) * block_k
    split_k = triton.cdiv(max(K, 1), k_per_split)
    grid_n = triton.cdiv(N, block_n)
    counts = counters(x.device, grid_n) if split_k > 1 else None
    if split_k > 1 and counts is None:  # a capture before arrivals.reserve: correct, but slower than it should be
        warnings.warn("skinny_matmul: no arrival counters for a split GEMV (a CUDA graph captured before "
                      "kernels.arrivals.reserve(device)?); running it unsplit", RuntimeWarning, stacklevel=2)
        split_k, k_per_split = 1, max(K, 1)
    parts = x if counts is None else torch.empty(split_k, M, 2 * N if gated else N, dtype=torch.float32,
                                                 device=x.device)
    if sumsq is not None:
        assert sumsq.dtype == torch.float32 and sumsq.is_contiguous() and sumsq.shape[1] == M
    if residual is not None:
        assert residual.shape == (M, N) and residual.stride(-1) == 1 and not gated
        sumsq_out = torch.empty(grid_n, M, dtype=torch.float32, device=x.device)
    use_pdl = pdl.active(x)
    _skinny_kernel[(grid_n, split_k)](
        x, weight, weight_scale if fp8 else x, bias if bias is not None else x, out, sumsq if sumsq is not None else x,
        residual if residual is not None else x, sumsq_out if residual is not None else x, parts,
        x if counts is None else counts, M, N, K, k_per_split, split_k, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, sumsq.shape[0] if sumsq is not None else 0, eps,
        HAS_BIAS=bias is not None, M_PAD=max(16, triton.next_power_of_2(M)),
        BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, RMS_IN=sumsq is not None,
        SUMSQ_PAD=triton.next_power_of_2(sumsq.shape[0]) if sumsq is not None else 1,
        ADD_RESIDUAL=residual is not None, UPCAST=not x.is_cuda, W_FP8=fp8, NORM_X=fp8 and sumsq is not None,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",  # fp32 weights: no silent tf32
        SPLIT=split_k > 1, PDL=use_pdl, launch_pdl=use_pdl, num_warps=num_warps, num_stages=num_stages)
    return (out, sumsq_out) if residual is not None else out
