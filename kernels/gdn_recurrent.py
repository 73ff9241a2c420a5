"""The gated delta rule's decode step in Triton: one token per sequence, its state read and written in its slot.

One launch does what ops.recurrent_gated_delta_rule does with the references: the gating (g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)), the q/k L2 norm (q scaled by Dk^-0.5), then per value head
S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, in fp32. ssm_state [slots, Hv, Dk, Dv] is in the state
cache's dtype: fp32, or bf16 / fp16 read up to fp32 and rounded once on the way back. A slot of -1 is a padding
row: zero output, nothing read or written. No host syncs, fixed launch shape for a given batch: a decode step
captures in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

# (value columns a program, warps) by the state's storage dtype: [128, 64] tiles, 4 warps for fp32 and 2 for a
# half-precision state, whose 64 columns are one 128-byte row segment. benchmarks/gdn_tile_bench.py at the 27B
# shape, batch 256 on the H200: bf16 288 against 430 µs a layer for the [128, 32] x 4 warps tile (2.80 TB/s),
# fp32 423 against 494 (3.81 TB/s); at batch 64 and 376 the same tiles win.
TILES = {torch.float32: (64, 4), torch.bfloat16: (64, 2), torch.float16: (64, 2)}


def check_state(ssm_state, Hv, Dk, Dv) -> None:
    """The recurrent state's storage is one TILES has a tile for; the maths is fp32 whatever it is."""
    if ssm_state.dtype not in TILES or ssm_state.shape[1:] != (Hv, Dk, Dv) or ssm_state.stride(2) != Dv \
            or ssm_state.stride(3) != 1:
        raise ValueError(f"ssm_state must be fp32, bf16 or fp16 [slots, {Hv}, {Dk}, {Dv}] with contiguous [Dk, Dv] "
                         f"tiles, got {ssm_state.dtype} {tuple(ssm_state.shape)}")


@triton.jit
def softplus(x):
    """torch's F.softplus (beta 1, threshold 20)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, o_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_a, stride_b,
                      stride_s0, stride_s1, Hv, scale, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr):
    """One (sequence, value head, BV value columns) per program; the [Dk, BV] state tile stays in registers."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    vcols = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vcols < DV
    slot = tl.load(slots_ptr + i).to(tl.int64)
    o_row = o_ptr + (i.to(tl.int64) * Hv + h) * DV + vcols
    if slot < 0:
        tl.store(o_row, tl.zeros([BV], dtype=o_ptr.dtype.element_ty), mask=vmask)
        return
    kr = tl.arange(0, BK)
    kmask = kr < DK
    hk = h // REP  # GQA of the rule: Hv / Hk consecutive value heads share a q/k head
    q = tl.load(q_ptr + i.to(tl.int64) * stride_qt + hk * stride_qh + kr, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + i.to(tl.int64) * stride_kt + hk * stride_kh + kr, mask=kmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
    v = tl.load(v_ptr + i.to(tl.int64) * stride_vt + h * stride_vh + vcols, mask=vmask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + i.to(tl.int64) * stride_a + h).to(tl.float32)
    bb = tl.load(b_ptr + i.to(tl.int64) * stride_b + h).to(tl.float32)
    g = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus(a + tl.load(dt_bias_ptr + h).to(tl.float32))
    beta = tl.sigmoid(bb)
    s_ptrs = state_ptr + slot * stride_s0 + h * stride_s1 + kr[:, None] * DV + vcols[None, :]
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta
    S = S + k[:, None] * delta[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=smask)
    tl.store(o_row, tl.sum(S * q[:, None], 0).to(o_ptr.dtype.element_ty), mask=vmask)


def recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, eps=1e-6, block_v=None,
                               num_warps=None):
    """q, k [B, Hk, Dk], v [B, Hv, Dv] (strided views of the conv output), a, b [B, Hv] (views of the in-projection),
    ssm_state [slots, Hv, Dk, Dv] (a dtype of TILES) -> o [B, Hv, Dv] in v.dtype; each row's slot state advanced in
    place. block_v / num_warps: the tile's value columns and the program's warps (default: TILES for the state's
    dtype; benchmarks/gdn_tile_bench.py sweeps them)."""
    B, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    check_state(ssm_state, Hv, Dk, Dv)
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("recurrent_gated_delta_rule wants unit-stride head dims")
    o = torch.empty(B, Hv, Dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    bk = triton.next_power_of_2(Dk)
    tile_v, warps = TILES[ssm_state.dtype]
    bv = min(triton.next_power_of_2(Dv), block_v or tile_v)
    _recurrent_kernel[(B, Hv, triton.cdiv(Dv, bv))](
        q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots.to(torch.int32), o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), Hv, Dk**-0.5, REP=Hv // Hk, DK=Dk, DV=Dv, BK=bk, BV=bv, EPS=eps,
        num_warps=num_warps or warps)
    return o
