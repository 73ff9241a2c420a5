"""The chunked gated delta rule in Triton: prompt chunks of varlen packed sequences, each from and back to its slot.

The form of gdn_reference.chunk_gated_delta_rule_one (chunks of 64 tokens restarting at every sequence start):
  1. per (chunk, value head), in parallel: G = cumsum(g) in the chunk, A = strictly-lower(beta_i k_i.k_j e^(G_i-G_j)),
     X = (I + A)^-1 by blocked forward substitution, w = X (beta k e^G), u = X (beta v), and the decayed causal
     q.k scores of the chunk;
  2. per (sequence, value head, value columns), over its chunks in order: v' = u - w S, o = (q e^G) S + scores v',
     S = e^(G_last) S + (k e^(G_last - G))^T v'; the final S goes back to the slot.
In a half-precision model every product's operands are in the model dtype with fp32 accumulation, the state
carried in fp32 between chunks (FLA's rule, the kernels vLLM serves Qwen3.5 with); only the inverse (I + A)^-1
runs on fp32 operands. An fp32 model keeps fp32 operands throughout ("ieee" dots: the fp32 tests).
No host syncs: each program finds its chunk from device-side chunk offsets, over a grid sized by the token and
sequence counts alone, so a prompt or mixed step captures in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from .gdn_recurrent import check_state
from .gdn_reference import gdn_gating

CHUNK = 64
# sm_90, 27B shape, bf16 (benchmarks/gdn_tile_bench.py --prefill, one layer, 28 sequences of 64..1,024 tokens,
# 16,384 in all, H100): 4 warps for both passes, 64 value columns a state program and two pipeline stages take
# 2,749 µs, vLLM's FLA rule 2,743 and the fp32-operand kernels before 4,659. The state loop apart from a parallel
# output pass (FLA's layout, each chunk's state stored) was slower at 3,225: commit 0782688, launch "split". fp32
# operands keep one stage: two would not fit the 227 KB of shared memory a block may have.
PREPARE_WARPS = 4
STATE_WARPS = 4
STATE_STAGES = {"half": 2, "fp32": 1}
STATE_BV = 64


@triton.jit(do_not_specialize=["n_seqs"])
def _chunk_prepare_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, chunk_cu_ptr, chunk_seq_ptr, G_ptr, w_ptr,
                          u_ptr, aq_ptr, n_seqs, stride_qt, stride_qh, stride_vt, stride_vh, Hv, REP: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr, SB: tl.constexpr = 16):
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    seq = tl.load(chunk_seq_ptr + c)
    if seq >= n_seqs:  # the grid's spare programs: it is sized for the most chunks T tokens can make
        return
    op = w_ptr.dtype.element_ty  # the products' operand dtype: the model's, or fp32
    t0 = tl.load(cu_ptr + seq) + (c - tl.load(chunk_cu_ptr + seq)) * BT
    t1 = tl.minimum(t0 + BT, tl.load(cu_ptr + seq + 1))
    r = tl.arange(0, BT)
    rows = t0 + r
    rmask = rows < t1
    rows64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows64 * Hv + h, mask=rmask, other=0.0)
    beta = tl.load(beta_ptr + rows64 * Hv + h, mask=rmask, other=0.0)
    G = tl.cumsum(g, 0)
    tl.store(G_ptr + rows64 * Hv + h, G, mask=rmask)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    Aq = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in tl.static_range(0, DK, BK):
        kc = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (kc < DK)[None, :]
        off = rows64[:, None] * stride_qt + hk * stride_qh + kc[None, :]
        kt = tl.load(k_ptr + off, mask=m, other=0.0)
        qt = tl.load(q_ptr + off, mask=m, other=0.0)
        A += tl.dot((kt * beta[:, None]).to(op), tl.trans(kt), input_precision=PREC)
        Aq += tl.dot(qt, tl.trans(kt), input_precision=PREC)
    ii, jj = r[:, None], r[None, :]
    dG = G[:, None] - G[None, :]
    valid = rmask[:, None] & rmask[None, :]
    A = tl.where((ii > jj) & valid, A * tl.exp(tl.where(ii > jj, dG, 0.0)), 0.0)
    Aq = tl.where((ii >= jj) & valid, Aq * tl.exp(tl.where(ii >= jj, dG, 0.0)), 0.0)
    tl.store(aq_ptr + (rows64[:, None] * Hv + h) * BT + jj, Aq.to(op), mask=rmask[:, None])
    # X = (I + A)^-1 in blocks of SB: A = D + L (D its SB x SB diagonal blocks, L strictly block-lower), so
    # I + A = (I + D)(I + N) with N = (I + D)^-1 L, nilpotent of order BT / SB = 4, and
    # X = (I - N (I - N (I - N))) (I + D)^-1: blocked forward substitution, in four tensor-core products.
    # (I + D)^-1 by forward substitution, the four blocks' row r at once: Dm holds (I + D)^-1 - I; a row of
    # block b is nonzero only in b's columns, so the four rows summed into one vector stay apart.
    # These products keep fp32 operands (tf32 in a half model): X's error would reach every w and u.
    eye = tl.where(ii == jj, 1.0, 0.0)
    same = (ii // SB) == (jj // SB)
    Dm = tl.where(same, -A, 0.0)
    for i in range(1, SB):
        sel = (r % SB) == i
        row = tl.sum(tl.where(sel[:, None], Dm, 0.0), 0)
        row = row + tl.sum(row[:, None] * Dm, 0)
        Dm = tl.where(sel[:, None] & same, row[None, :], Dm)
    Dinv = Dm + eye
    N = tl.dot(Dinv, tl.where(same, 0.0, A), input_precision=PREC)
    Y = eye - N
    Y = eye - tl.dot(N, Y, input_precision=PREC)
    Y = eye - tl.dot(N, Y, input_precision=PREC)
    X = tl.dot(Y, Dinv, input_precision=PREC).to(op)
    for k0 in tl.static_range(0, DK, BK):
        kc = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (kc < DK)[None, :]
        kt = tl.load(k_ptr + rows64[:, None] * stride_qt + hk * stride_qh + kc[None, :], mask=m, other=0.0)
        w = tl.dot(X, (kt * (beta * tl.exp(G))[:, None]).to(op), input_precision=PREC)
        tl.store(w_ptr + (rows64[:, None] * Hv + h) * DK + kc[None, :], w.to(op), mask=m)
    for v0 in tl.static_range(0, DV, BV):
        vc = v0 + tl.arange(0, BV)
        m = rmask[:, None] & (vc < DV)[None, :]
        vt = tl.load(v_ptr + rows64[:, None] * stride_vt + h * stride_vh + vc[None, :], mask=m, other=0.0)
        u = tl.dot(X, (vt.to(tl.float32) * beta[:, None]).to(op), input_precision=PREC)
        tl.store(u_ptr + (rows64[:, None] * Hv + h) * DV + vc[None, :], u.to(op), mask=m)


@triton.jit
def _qk_l2norm_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, T, stride_t, stride_h, scale, eps, HK: tl.constexpr,
                      DK: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    """q and k rows l2-normalised in fp32 (q also scaled), written contiguous in the products' dtype."""
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1)
    kc = tl.arange(0, BK)
    m = (t < T)[:, None] & (kc < DK)[None, :]
    t64 = t.to(tl.int64)
    src = t64[:, None] * stride_t + h * stride_h + kc[None, :]
    dst = (t64[:, None] * HK + h) * DK + kc[None, :]
    q = tl.load(q_ptr + src, mask=m, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + eps) * scale)[:, None]
    tl.store(qn_ptr + dst, q.to(qn_ptr.dtype.element_ty), mask=m)
    k = tl.load(k_ptr + src, mask=m, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    tl.store(kn_ptr + dst, k.to(kn_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_state_kernel(q_ptr, k_ptr, G_ptr, w_ptr, u_ptr, aq_ptr, state_ptr, cu_ptr, slot_ptr, o_ptr,
                        stride_qt, stride_qh, stride_s0, stride_s1, Hv, REP: tl.constexpr, DK: tl.constexpr,
                        DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        PREC: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // REP
    vc = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = vc < DV
    t0 = tl.load(cu_ptr + s)
    t1 = tl.load(cu_ptr + s + 1)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    if slot < 0 or t1 <= t0:
        return
    op = w_ptr.dtype.element_ty
    kr = tl.arange(0, BK)
    kmask = kr < DK
    r = tl.arange(0, BT)
    s_ptrs = state_ptr + slot * stride_s0 + h * stride_s1 + kr[:, None] * DV + vc[None, :]
    S = tl.load(s_ptrs, mask=kmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
    for c0 in range(t0, t1, BT):
        rows = c0 + r
        rmask = rows < t1
        rows64 = rows.to(tl.int64)
        G = tl.load(G_ptr + rows64 * Hv + h, mask=rmask, other=0.0)
        G_last = tl.load(G_ptr + (tl.minimum(c0 + BT, t1) - 1).to(tl.int64) * Hv + h)
        mk = rmask[:, None] & kmask[None, :]
        mv = rmask[:, None] & vmask[None, :]
        Sop = S.to(op)
        w = tl.load(w_ptr + (rows64[:, None] * Hv + h) * DK + kr[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + (rows64[:, None] * Hv + h) * DV + vc[None, :], mask=mv, other=0.0)
        v_new = (u.to(tl.float32) - tl.dot(w, Sop, input_precision=PREC)).to(op)
        qk_off = rows64[:, None] * stride_qt + hk * stride_qh + kr[None, :]
        q = tl.load(q_ptr + qk_off, mask=mk, other=0.0)
        aq = tl.load(aq_ptr + (rows64[:, None] * Hv + h) * BT + r[None, :], mask=rmask[:, None], other=0.0)
        o = tl.dot((q * tl.exp(G)[:, None]).to(op), Sop, input_precision=PREC)
        o += tl.dot(aq, v_new, input_precision=PREC)
        tl.store(o_ptr + (rows64[:, None] * Hv + h) * DV + vc[None, :], o.to(o_ptr.dtype.element_ty), mask=mv)
        k = tl.load(k_ptr + qk_off, mask=mk, other=0.0)
        kd = (k * tl.exp(G_last - G)[:, None]).to(op)
        S = S * tl.exp(G_last) + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=kmask[:, None] & vmask[None, :])


def chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, cu_seqlens, eps=1e-6,
                           precision=None, launch=None):
    """q, k [T, Hk, Dk], v [T, Hv, Dv] straight from the conv, a, b [T, Hv] (in-projection views), ssm_state
    [slots, Hv, Dk, Dv] (fp32, bf16 or fp16: the state loop runs in fp32 either way), state_slots [num_seqs]
    (-1: padding), cu_seqlens [num_seqs + 1] -> o [T, Hv, Dv] in v.dtype (zero on padding rows); each sequence
    starts from and leaves its state in its slot.

    precision: tl.dot's input precision for fp32 operands; default "ieee" for fp32 models (the fp32 tests),
    "tf32" for half precision ones (their inverse). launch: overrides of the launch settings ({"prepare_warps",
    "state_warps", "state_stages", "state_bv"}; benchmarks/gdn_tile_bench.py sweeps them)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    check_state(ssm_state, Hv, Dk, Dv)
    if Dk < 16 or Dv < 16:
        raise ValueError(f"the chunked rule's tiles need head dims of at least 16, got {Dk}, {Dv}")
    if v.stride(2) != 1:
        v = v.contiguous()
    half = v.dtype in (torch.bfloat16, torch.float16)
    op = v.dtype if half else torch.float32
    precision = precision or ("tf32" if half else "ieee")
    n = state_slots.shape[0]
    launch = {**LAUNCH, **(launch or {})}
    if T == 0 or n == 0:
        return torch.zeros(T, Hv, Dv, dtype=v.dtype, device=v.device)
    dev = v.device
    slots, cu = state_slots.to(torch.int32), cu_seqlens.to(torch.int32)
    # chunk c of the step is chunk c - chunk_cu[s] of sequence s = chunk_seq[c]; padding sequences have none
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    per_seq = torch.where(slots >= 0, (lens + CHUNK - 1).div(CHUNK, rounding_mode="floor"), 0)
    chunk_cu = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    chunk_cu[1:] = per_seq.cumsum(0)
    max_chunks = T // CHUNK + n  # sum of ceil(len / CHUNK) <= T / CHUNK + n
    chunk_seq = torch.searchsorted(chunk_cu[1:], torch.arange(max_chunks, dtype=torch.int32, device=dev),
                                   right=True).to(torch.int32)
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    g, beta = g.contiguous(), beta.contiguous()
    qn = torch.empty(T, Hk, Dk, dtype=op, device=dev)
    kn = torch.empty(T, Hk, Dk, dtype=op, device=dev)
    if q.stride() != k.stride() or q.stride(2) != 1:  # the conv output's views share strides: one kernel reads both
        q, k = q.contiguous(), k.contiguous()
    rows = 16
    _qk_l2norm_kernel[(triton.cdiv(T, rows), Hk)](q, k, qn, kn, T, q.stride(0), q.stride(1), Dk**-0.5, eps, HK=Hk,
                                                  DK=Dk, BK=triton.next_power_of_2(Dk), ROWS=rows)
    G = torch.empty(T, Hv, dtype=torch.float32, device=dev)
    w = torch.empty(T, Hv, Dk, dtype=op, device=dev)
    u = torch.empty(T, Hv, Dv, dtype=op, device=dev)
    aq = torch.empty(T, Hv, CHUNK, dtype=op, device=dev)
    prepare, state = tiles(Dk, Dv, launch["state_bv"])
    o = torch.zeros(T, Hv, Dv, dtype=v.dtype, device=dev)  # padding rows stay zero: the loop writes the sequences'
    _chunk_prepare_kernel[(max_chunks, Hv)](
        qn, kn, v, g, beta, cu, chunk_cu, chunk_seq, G, w, u, aq, n, qn.stride(0), qn.stride(1), v.stride(0),
        v.stride(1), Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BT=CHUNK, PREC=precision,
        num_warps=launch["prepare_warps"], **prepare)
    _chunk_state_kernel[(n, Hv, triton.cdiv(Dv, state["BV"]))](
        qn, kn, G, w, u, aq, ssm_state, cu, slots, o, qn.stride(0), qn.stride(1), ssm_state.stride(0),
        ssm_state.stride(1), Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BT=CHUNK, PREC=precision, num_warps=launch["state_warps"],
        num_stages=launch["state_stages"] or STATE_STAGES["half" if half else "fp32"], **state)
    return o


# the launch settings; benchmarks/gdn_tile_bench.py --prefill sweeps them
LAUNCH = {"prepare_warps": PREPARE_WARPS, "state_warps": STATE_WARPS, "state_stages": None,  # None: STATE_STAGES
          "state_bv": STATE_BV}


def tiles(Dk, Dv, state_bv=STATE_BV) -> tuple[dict, dict]:
    """The two kernels' tile constants: the prepare pass loops over 64-wide slices of Dk and Dv; the state loop
    holds a whole [Dk, state_bv] state slice. No tile is narrower than MIN_TILE (the masks zero the extra
    columns)."""
    return ({"BK": _tile(Dk, 64), "BV": _tile(Dv, 64)}, {"BK": _tile(Dk), "BV": _tile(Dv, state_bv)})


# Triton 3.6's sm_90 products on 16-wide half-precision tiles read out of bounds: a model with 16-dim DeltaNet
# heads (tests/engine/test_hybrid_engine.py's tiny Qwen3.5) faulted in the prepare pass on an H100 under bf16 and
# fp16, and ran at 32
MIN_TILE = 32


def _tile(dim: int, cap: int | None = None) -> int:
    width = triton.next_power_of_2(dim)
    return max(min(width, cap) if cap else width, MIN_TILE)
