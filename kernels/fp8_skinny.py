"""Weight-only FP8 GEMM for decode steps of 33..128 rows: y = x (bf16) @ (W_e4m3 * w_scale)^T on tensor cores.

Past 32 rows the GEMV (gemv.py) runs out of FMA throughput on its fp16 dot and quantise + torch._scaled_mm
(fp8.py) runs far below the weight-read bandwidth, though a decode step of 64 rows is still a weight read.
Here each program owns BLOCK_N weight rows (output columns) and one K slice, loads each e4m3 weight tile,
converts it to bf16 in registers (exact: bf16 holds every e4m3 value) and runs tl.dot against the x tile
with fp32 accumulation; all M rows (up to 128, padded to a power of two by masking) sit in one BLOCK_M, so
the weight is streamed from HBM once and x is re-read from L2. x is not quantised ("w8a16"), so the result
is a bf16 GEMM's over the dequantised weight (reference.skinny_matmul with weight_scale).

The product is computed transposed, acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T: the converted weight is the
dot's first operand, the one Hopper's wgmma may take from registers, and BLOCK_N fills its 64-row M side
whatever the batch. The per-column scale, bias and the gated SiLU-and-mul run in the epilogue. Split K
merges through the arrival counters (arrivals.py) as the GEMV does: each slice stores an fp32 partial and the
last slice of a column tile to arrive sums them in slice order, so results are deterministic and a linear
is one launch, with no host sync (CUDA graphs capture it).

Not timed on a GPU yet: default_config is a starting point for benchmarks/gemv_bench.py --fp8-dot-configs.
"""
import warnings

import torch
import triton
import triton.language as tl

from .arrivals import counters
from .gemv_tiles import sm_count

MAX_ROWS = 128  # one BLOCK_M holds every row


@triton.jit
def _tile(acc, acc_up, x_ptr, w_ptr, x_rows, m_mask, w_rows, up_rows, k0, k_stop, BLOCK_K: tl.constexpr,
          MASK: tl.constexpr, GATED: tl.constexpr, UPCAST: tl.constexpr):
    """acc (+ acc_up) += weight[rows, k0:k0+BLOCK_K] @ x[:, k0:k0+BLOCK_K]^T; MASK only on a K tail. The x
    tile is loaded once for both halves of a gated weight."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if MASK:
        k_mask = offs_k[None, :] < k_stop
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=k_mask, other=0.0)
        if GATED:
            w_up = tl.load(w_ptr + up_rows[:, None] + offs_k[None, :], mask=k_mask, other=0.0)
    else:  # no predicate on the weight: its loads stay 16 bytes wide
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :])
        if GATED:
            w_up = tl.load(w_ptr + up_rows[:, None] + offs_k[None, :])
    if UPCAST:  # the interpreter mishandles half-precision arithmetic: fp32 there, same products
        xt = tl.trans(x.to(tl.float32))
        acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
        if GATED:
            acc_up = tl.dot(w_up.to(tl.float32), xt, acc_up, input_precision="ieee")
    else:
        xt = tl.trans(x)  # bf16 (or fp16) rows: the weight converts to their dtype, exactly for e4m3
        acc = tl.dot(w.to(x.dtype), xt, acc)
        if GATED:
            acc_up = tl.dot(w_up.to(x.dtype), xt, acc_up)
    return acc, acc_up


@triton.jit
def _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om,
              HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Per-column scale (sum(x_k * q_nk * s_n) = s_n * sum(x_k * q_nk)), bias, silu(gate) * up, the store."""
    acc *= tl.load(scale_ptr + offs_n % N)[:, None]
    if GATED:
        acc_up *= tl.load(scale_ptr + N + offs_n % N)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:  # as the unfused path and the GEMV: both products rounded to the model dtype, then fp32
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["M", "split_k"])  # batch sizes up to BLOCK_M share one compile
def _fp8_dot_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, counts_ptr, M, N, K, k_per_split, split_k,
                    stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Program (n tile, k slice): out[:, n tile] = x @ (weight[n tile] * scale)^T (+ bias) over one K slice.

    GATED: weight packs [gate; up] (2N rows, scale 2N) and out = silu(gate) * up, [M, N].
    SPLIT: each of split_k slices stores its fp32 partial at part_ptr [split_k, M, N or 2N]; the last to
    arrive at its tile's counter (counts_ptr) sums them in slice order, finishes and sets the counter to 0.
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Rows past N re-read row n % N: every weight load is in bounds without a mask, and those columns are
    # never stored. int64: the offsets of a large weight pass 2**31.
    w_rows = (offs_n % N).to(tl.int64) * stride_wn
    up_rows = w_rows + N * stride_wn
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_rows = offs_m.to(tl.int64) * stride_xm
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    k_full = k_start + (k_stop - k_start) // BLOCK_K * BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = acc
    for k0 in range(k_start, k_full, BLOCK_K):
        acc, acc_up = _tile(acc, acc_up, x_ptr, w_ptr, x_rows, m_mask, w_rows, up_rows, k0, k_stop, BLOCK_K, False,
                            GATED, UPCAST)
    if k_full < k_stop:
        acc, acc_up = _tile(acc, acc_up, x_ptr, w_ptr, x_rows, m_mask, w_rows, up_rows, k_full, k_stop, BLOCK_K,
                            True, GATED, UPCAST)
    if SPLIT:
        width = 2 * N if GATED else N
        part_mask = n_mask[:, None] & m_mask[None, :]
        cols = offs_m[None, :] * width + offs_n[:, None]
        tl.store(part_ptr + pid_k * M * width + cols, acc, mask=part_mask)
        if GATED:
            tl.store(part_ptr + pid_k * M * width + N + cols, acc_up, mask=part_mask)
        # The partial stores come before the release; the last arrival's acquire makes every slice's visible.
        tl.debug_barrier()
        if tl.atomic_add(counts_ptr + pid_n, 1, sem="acq_rel") == split_k - 1:
            tl.store(counts_ptr + pid_n, 0)  # back to 0 for the next launch
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = acc
            for s in range(split_k):
                acc += tl.load(part_ptr + s * M * width + cols, mask=part_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptr + s * M * width + N + cols, mask=part_mask, other=0.0,
                                      cache_modifier=".cg")
            _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om,
                      HAS_BIAS, GATED)
    else:
        _epilogue(acc, acc_up, scale_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_om, HAS_BIAS,
                  GATED)


def block_m(M):
    """The rows one program holds: M padded to a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(M))


def default_config(M, N, K, num_sms=132, gated=False, block_n=64, block_k=128):
    """(block_n, block_k, num_warps, num_stages, split_k) for x [M, K] @ weight [N (2N gated), K].T.

    Untimed defaults: 64 weight rows a program (wgmma's M side, one warpgroup), 128-wide K tiles, and K
    split in powers of two while the grid has under ~1.5 programs an SM, but no further than keeps each
    slice 4 K tiles long and the fp32 partials (split_k x M x N x 4 bytes, written and read once) at most
    half the weight's bytes (at 128 rows they move as many bytes as the weight from split_k = K / 1024,
    though mostly through L2).
    Stages: 4 while a stage (weight tile + x tile) is under 32 KB, else 3.
    """
    grid_n = triton.cdiv(N, block_n)
    split_k = 1
    while (split_k < 8 and grid_n * split_k * 2 <= 3 * num_sms and K // (2 * split_k) >= 4 * block_k
           and 16 * split_k * M <= K // 2):
        split_k *= 2
    stage_bytes = block_n * block_k * (2 if gated else 1) + block_m(M) * block_k * 2
    return block_n, block_k, 4, 4 if stage_bytes <= 32 * 1024 else 3, split_k


def fp8_dot(x, weight, weight_scale, bias=None, out=None, gated=False, block_n=None, block_k=None, num_warps=None,
            num_stages=None, split_k=None):
    """x [M, K] (bf16 / fp16) @ (weight [N, K] e4m3 * weight_scale [N] fp32)^T (+ bias [N]) -> [M, N] in x.dtype.

    M <= 128 (MAX_ROWS); K a multiple of 16 as layers/fp8.Fp8Linear makes it, any K tail masked.
    gated=True: weight, weight_scale and bias pack [gate; up] and the result is silu(gate) * up, [M, N // 2].
    split_k > 1 needs the device's arrival counters (arrivals.reserve before a graph capture); without them
    the GEMM runs unsplit. Every launch parameter comes from the shapes, never from tensor values: no host sync.
    """
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    assert M <= MAX_ROWS, f"fp8_dot holds at most {MAX_ROWS} rows, got {M}"
    assert weight.shape[1] == K and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert (weight.dtype == torch.float8_e4m3fn and weight_scale.dtype == torch.float32
            and weight_scale.shape == (weight.shape[0],) and weight_scale.is_contiguous())
    assert not gated or weight.shape[0] % 2 == 0
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (M, N) and out.stride(-1) == 1
    if M == 0 or N == 0:
        return out
    defaults = default_config(M, N, K, sm_count(x.device), gated, block_n or 64, block_k or 128)
    block_n, block_k, num_warps, num_stages, split_k = (
        given or default for given, default in zip((block_n, block_k, num_warps, num_stages, split_k), defaults,
                                                   strict=True))
    if block_n < 16 or block_k < 16:
        raise ValueError(f"block_n={block_n}, block_k={block_k}: tl.dot needs 16 or more")
    # Whole BLOCK_K tiles per slice, and no empty slice.
    k_per_split = triton.cdiv(triton.cdiv(max(K, 1), split_k), block_k) * block_k
    split_k = triton.cdiv(max(K, 1), k_per_split)
    grid_n = triton.cdiv(N, block_n)
    counts = counters(x.device, grid_n) if split_k > 1 else None
    if split_k > 1 and counts is None:  # a capture before arrivals.reserve: correct, but slower than it should be
        warnings.warn("fp8_dot: no arrival counters for a split GEMM (a CUDA graph captured before "
                      "kernels.arrivals.reserve(device)?); running it unsplit", RuntimeWarning, stacklevel=2)
        split_k, k_per_split = 1, max(K, 1)
    parts = x if counts is None else torch.empty(split_k, M, 2 * N if gated else N, dtype=torch.float32,
                                                 device=x.device)
    _fp8_dot_kernel[(grid_n, split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, parts,
        x if counts is None else counts, M, N, K, k_per_split, split_k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=block_m(M), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT=split_k > 1, UPCAST=not x.is_cuda, num_warps=num_warps, num_stages=num_stages)
    return out
