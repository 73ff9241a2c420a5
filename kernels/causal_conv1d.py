"""Depthwise causal conv1d + SiLU of Gated DeltaNet in Triton, per state slot: the decode update and the varlen prefill.

Layouts and rounding as gdn_reference.causal_conv1d: x [T, C] (unit column stride, any row stride), weight [C, K],
conv_state [slots, C, K - 1] (oldest input first, model dtype), fp32 maths, y in x.dtype; a sequence whose slot
is -1 is a padding row (zero output, no state read or write). No host syncs: a decode launch captures in a graph.
"""
import torch
import triton
import triton.language as tl

DECODE_BLOCK_C = 256
# 16 x 128 tiles: at 16 x 256 the K shifted loads spill (255 registers, sm_90; tests/kernels/test_gdn_compile.py)
PREFILL_BLOCK_T, PREFILL_BLOCK_C = 16, 128


@triton.jit(do_not_specialize=["n_seqs"])
def _conv_decode_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr, n_seqs, C, stride_x, stride_s0, stride_s1,
                        K: tl.constexpr, BLOCK_C: tl.constexpr):
    """One token per sequence: y = silu(sum_j w[K-1-j] * input(t - j)), then the window slides by one."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    y_row = y_ptr + b.to(tl.int64) * C + cols
    if slot < 0:
        tl.store(y_row, tl.zeros([BLOCK_C], dtype=y_ptr.dtype.element_ty), mask=cmask)
        return
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + cols * K + (K - 1), mask=cmask, other=0.0).to(tl.float32)
    s_row = state_ptr + slot * stride_s0 + cols * stride_s1
    for j in tl.static_range(K - 1):  # state column j is input(t - (K - 1 - j))
        s = tl.load(s_row + j, mask=cmask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(s_row + (j - 1), s, mask=cmask)
    tl.store(s_row + (K - 2), x.to(state_ptr.dtype.element_ty), mask=cmask)
    tl.store(y_row, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["T"])
def _conv_prefill_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, seq_of_ptr, y_ptr, T, C, stride_x, stride_s0,
                         stride_s1, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """BLOCK_T packed tokens x BLOCK_C channels; each token reads its K - 1 predecessors from x, or from its slot's
    conv state before the sequence start. The state is only read here (the update is the next launch)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask, cmask = rows < T, cols < C
    seq = tl.load(seq_of_ptr + rows, mask=rmask, other=0)
    start = tl.load(cu_ptr + seq, mask=rmask, other=0)
    end = tl.load(cu_ptr + seq + 1, mask=rmask, other=0)
    slot = tl.load(slots_ptr + seq, mask=rmask, other=-1).to(tl.int64)
    live = rmask & (slot >= 0) & (rows < end)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # input(t - j) times w[K - 1 - j]
        pos = rows - j
        in_x = live & (pos >= start)
        in_s = live & (pos < start)
        xv = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_x + cols[None, :],
                     mask=in_x[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        scol = (K - 1) - (start - pos)  # the state column of input(pos) before the start
        sv = tl.load(state_ptr + (slot * stride_s0)[:, None] + cols[None, :] * stride_s1 + scol[:, None],
                     mask=in_s[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    y = tl.where(live[:, None], acc * tl.sigmoid(acc), 0.0)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, cu_ptr, C, stride_x, stride_s0, stride_s1,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each sequence's slot keeps its last K - 1 inputs: from x, or shifted within the old state when the
    sequence is shorter than K - 1 (the old columns are loaded before any is written)."""
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    start, end = tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)
    if slot < 0 or end <= start:
        return
    j = tl.arange(0, KP)
    pos = end - (K - 1) + j  # new state column j holds input(pos)
    jmask = j < K - 1
    m = jmask[:, None] & (cols < C)[None, :]
    xv = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m & (pos >= start)[:, None],
                 other=0.0)
    base = state_ptr + slot * stride_s0 + cols[None, :] * stride_s1
    old = tl.load(base + ((K - 1) - (start - pos))[:, None], mask=m & (pos < start)[:, None], other=0.0)
    new = tl.where((pos >= start)[:, None], xv.to(state_ptr.dtype.element_ty), old)
    tl.store(base + j[:, None], new, mask=m)


def _check(x, weight, conv_state):
    if x.stride(1) != 1 or conv_state.stride(2) != 1:
        raise ValueError("causal_conv1d wants unit-stride channels in x and a [slots, C, K - 1] conv state")
    if weight.shape != (x.shape[1], conv_state.shape[2] + 1):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} and state "
                         f"{tuple(conv_state.shape)}")


def causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None):
    """As gdn_reference.causal_conv1d: -> y [T, C] in x.dtype; conv_state updated in place per slot."""
    _check(x, weight, conv_state)
    T, C = x.shape
    K = weight.shape[1]
    weight = weight.contiguous()
    slots = state_slots.to(torch.int32)
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block_c = min(DECODE_BLOCK_C, triton.next_power_of_2(C))
    if cu_seqlens is None:
        _conv_decode_kernel[(T, triton.cdiv(C, block_c))](
            x, weight, conv_state, slots, y, T, C, x.stride(0), conv_state.stride(0), conv_state.stride(1),
            K=K, BLOCK_C=block_c)
        return y
    cu = cu_seqlens.to(torch.int32)
    n = slots.shape[0]
    # each packed token's sequence, on the device (no sync): tokens past cu[-1] get sequence n - 1 and are masked
    seq_of = torch.searchsorted(cu[1:].contiguous(), torch.arange(T, device=x.device, dtype=torch.int32),
                                right=True).clamp_(max=n - 1).to(torch.int32)
    block_t, block_tc = PREFILL_BLOCK_T, min(PREFILL_BLOCK_C, block_c)
    _conv_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_tc))](
        x, weight, conv_state, slots, cu, seq_of, y, T, C, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, BLOCK_T=block_t, BLOCK_C=block_tc)
    _conv_state_kernel[(n, triton.cdiv(C, block_c))](
        x, conv_state, slots, cu, C, x.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, KP=triton.next_power_of_2(K - 1), BLOCK_C=block_c)
    return y
