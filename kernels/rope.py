"""Rotary position embedding (neox / rotate-half layout) in Triton.

The cos/sin cache comes from reference.rope_cos_sin_cache, which folds llama3 scaling into the
inverse frequencies, so this kernel knows nothing of rope types.
"""
import torch
import triton
import triton.language as tl

from .kv_cache import cache_value


@triton.jit
def _rope_rows(x_ptr, out_ptr, token, cos, sin, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
               HEAD_DIM: tl.constexpr, HALF_ROT: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
               PASS_PAD: tl.constexpr):
    """Rotate all heads of one token: [heads, HALF_ROT] pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    heads = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF_ROT)
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh  # [heads, 1] row starts
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(src + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF_ROT + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    # rounded to the model dtype first: an fp8 key cache then holds what the reference's bf16 key rounds to
    x_dtype = x_ptr.dtype.element_ty
    tl.store(dst + offs[None, :], cache_value((x1 * cos[None, :] - x2 * sin[None, :]).to(x_dtype), out_ptr),
             mask=mask)
    tl.store(dst + HALF_ROT + offs[None, :], cache_value((x2 * cos[None, :] + x1 * sin[None, :]).to(x_dtype), out_ptr),
             mask=mask)
    if PASS_PAD > 0:  # partial rotary: the dims past the rotary part are copied unchanged
        rest = 2 * HALF_ROT + tl.arange(0, PASS_PAD)
        rmask = (heads[:, None] < num_heads) & (rest[None, :] < HEAD_DIM)
        tl.store(dst + rest[None, :], cache_value(tl.load(src + rest[None, :], mask=rmask), out_ptr), mask=rmask)


@triton.jit
def rotate_tile(x, row_ptrs, row_mask, cos_sin_row, offs_d, HALF_ROT: tl.constexpr):
    """x [rows, dims], loaded from row_ptrs[:, None] + offs_d[None, :], rotated at one position whose cos/sin
    row starts at cos_sin_row; -> x's dtype. Each dim's rotation partner is loaded here (a second read of
    the same cache lines), so the caller keeps its own layout. Dims past 2 * HALF_ROT pass through. The
    same arithmetic as _rope_rows, for the decode attention that rotates its own q and new key."""
    lo = offs_d < HALF_ROT
    rot = offs_d < 2 * HALF_ROT
    pair = tl.where(lo, offs_d, offs_d - HALF_ROT)
    partner = tl.load(row_ptrs[:, None] + tl.where(lo, offs_d + HALF_ROT, offs_d - HALF_ROT)[None, :],
                      mask=row_mask[:, None] & rot[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cos_sin_row + pair, mask=rot, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + HALF_ROT + pair, mask=rot, other=0.0).to(tl.float32)[None, :]
    xf = x.to(tl.float32)
    return tl.where(lo[None, :], xf * cos - partner * sin, xf * cos + partner * sin).to(x.dtype)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cache_ptr, num_q_heads, num_k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_cache, v_ptr, v_cache_ptr, slot_mapping_ptr, stride_vt, stride_vh, stride_cb, stride_vcb,
                 stride_co, stride_vco, stride_vch,
                 HEAD_DIM: tl.constexpr, HALF_ROT: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                 K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One token per program: q and k share its cos/sin row, read once.

    WRITE_KV: k_out is the paged key cache and the rotated key goes straight to the token's slot, with
    its value beside it (slot -1, padding: neither), so the step needs no separate cache-write kernel.
    """
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs = tl.arange(0, HALF_PAD)
    cmask = offs < HALF_ROT
    cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF_ROT + offs, mask=cmask, other=0.0).to(tl.float32)
    _rope_rows(q_ptr, q_out_ptr, token, cos, sin, num_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
               HEAD_DIM, HALF_ROT, Q_HEADS_PAD, HALF_PAD, PASS_PAD)
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block, in_block = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            # token stride 0 on the output side: the slot's row start is folded into the base pointer
            _rope_rows(k_ptr + token * stride_kt, k_out_ptr + block * stride_cb + in_block * stride_co, 0, cos, sin,
                       num_k_heads, 0, stride_kh, 0, stride_koh, HEAD_DIM, HALF_ROT, K_HEADS_PAD, HALF_PAD, PASS_PAD)
            heads = tl.arange(0, K_HEADS_PAD)
            dims = tl.arange(0, HEAD_DIM_PAD)
            vmask = (heads[:, None] < num_k_heads) & (dims[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=vmask)
            dst = v_cache_ptr + block * stride_vcb + in_block * stride_vco + heads[:, None] * stride_vch
            tl.store(dst + dims[None, :], cache_value(v, v_cache_ptr), mask=vmask)
    else:
        _rope_rows(k_ptr, k_out_ptr, token, cos, sin, num_k_heads, stride_kt, stride_kh, stride_kot, stride_koh,
                   HEAD_DIM, HALF_ROT, K_HEADS_PAD, HALF_PAD, PASS_PAD)


def _launch(q, k, q_out, k_out, positions, cos_sin_cache, kv_write):
    T, H, D = q.shape
    Hkv = k.shape[1]
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= D and q.stride(-1) == 1 and k.stride(-1) == 1 and k_out.stride(-1) == 1
    if T == 0:
        return
    half = rot // 2
    if kv_write is None:  # k_out [T, Hkv, D]; the value and cache arguments are unused
        v, v_cache, slots, block_size = q, q, positions, 1
        stride_kot, stride_koh = k_out.stride(0), k_out.stride(1)
        stride_vt = stride_vh = stride_cb = stride_vcb = stride_co = stride_vco = stride_vch = 0
    else:  # k_out is the key cache [blocks, block_size, Hkv, D], v_cache likewise
        v, v_cache, slots = kv_write
        assert v.stride(-1) == 1 and v_cache.stride(-1) == 1
        block_size = k_out.shape[1]
        stride_kot, stride_koh = 0, k_out.stride(2)
        stride_vt, stride_vh = v.stride(0), v.stride(1)
        stride_cb, stride_co = k_out.stride(0), k_out.stride(1)
        stride_vcb, stride_vco, stride_vch = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
    _rope_kernel[(T,)](
        q, k, q_out, k_out, positions, cos_sin_cache, H, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), stride_kot, stride_koh,
        cos_sin_cache.stride(0), v, v_cache, slots, stride_vt, stride_vh, stride_cb, stride_vcb, stride_co,
        stride_vco, stride_vch,
        HEAD_DIM=D, HALF_ROT=half, Q_HEADS_PAD=triton.next_power_of_2(H), K_HEADS_PAD=triton.next_power_of_2(Hkv),
        HALF_PAD=triton.next_power_of_2(half), PASS_PAD=triton.next_power_of_2(D - rot) if D > rot else 0,
        HEAD_DIM_PAD=triton.next_power_of_2(D), WRITE_KV=kv_write is not None, BLOCK_SIZE=block_size,
        num_warps=4)


def apply_rope(q, k, positions, cos_sin_cache, inplace=False):
    """q [T, H, D], k [T, Hkv, D], positions int64 [T], cos_sin_cache [max_pos, rot] -> (q, k) rotated.

    rot < D is partial rotary (the tail of each head passes through). inplace=True writes back into q, k.
    """
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _launch(q, k, q_out, k_out, positions, cos_sin_cache, None)
    return q_out, k_out


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Rotate q and k, and write the rotated k and v [T, Hkv, D] into the paged cache at slot_mapping
    (-1 = padding) in the same kernel. -> rotated q (a new tensor)."""
    q_out = torch.empty_like(q)
    _launch(q, k, q_out, k_cache, positions, cos_sin_cache, (v, v_cache, slot_mapping))
    return q_out
