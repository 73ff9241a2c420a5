"""Paged prefill attention in Triton: prefill, chunked prefill (a cached prefix plus new tokens) and the
prompt part of mixed steps, as packed variable-length causal attention over the paged KV cache.

Each program takes one tile of one sequence's queries for one KV head, with the query heads that share
that KV head packed into the M rows of the dot (GQA), and walks the keys with attention.py's online-softmax
tile. Layouts: see reference.py.
"""
import math

import torch
import triton
import triton.language as tl

from .attention import LOG2E, _attend_tile, dot_operand


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning q tile `tile`, where sequence s's tiles start at cu_seqlens_q[s] // BLOCK_Q + s."""
    lo: tl.int32 = 0  # typed: the loop-carried value must not change type when compiled
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])  # no recompile when the batch or table width changes
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
                    qk_scale, num_seqs,
                    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Program (q tile, kv_head): BLOCK_Q query tokens x GROUP heads (M = BLOCK_Q * GROUP_PAD rows)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    # Last tiles first: they see the most keys, so the long programs start early and the tail is short.
    tile, kv_head = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, within its sequence
    if first_q >= q_len:  # the grid is sized for the worst case; spare tiles exit
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # keys already cached before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    tok = first_q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_mask = (tok < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q = dot_operand(q, k_cache_ptr)  # fp16 over an e4m3 cache

    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    key_limit = prefix + tok  # causal: the query at absolute position p sees keys <= p
    block_table = block_tables_ptr + seq * stride_bt
    # Keys up to the tile's first query position are visible to every row: no masks there.
    full_end = (prefix + first_q + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(prefix + first_q + BLOCK_Q, seq_len)
    for tok0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head * stride_kh,
                                     kv_head * stride_vh, tok0, key_limit, kv_end, qk_scale, stride_kb, stride_ko,
                                     stride_vb, stride_vo, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False)
    for tok0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head * stride_kh,
                                     kv_head * stride_vh, tok0, key_limit, kv_end, qk_scale, stride_kb, stride_ko,
                                     stride_vb, stride_vo, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True)

    out = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=None, max_seq_len=None,
                            out=None, block_m=None, block_n=None, num_warps=None, num_stages=None):
    """Packed variable-length causal attention over the paged cache: q [T, H, D] -> [T, H, D].

    Serves prefill, chunked prefill (a cached prefix plus new tokens) and mixed prefill + decode steps.
    max_seq_len is accepted for symmetry with the decode launcher and is not needed.
    """
    T, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = H // Hkv
    group_pad = triton.next_power_of_2(group)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens_q.shape[0] - 1
    if T == 0 or num_seqs == 0:
        return out
    block_m = block_m or 128  # defaults swept on the H200: docs/benchmarks-kernels.md
    block_q = max(1, block_m // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs M >= 16
        block_q = triton.cdiv(16, group_pad)
    block_n = block_n or (128 if D <= 128 else 64)
    num_tiles = T // block_q + num_seqs  # upper bound of sum(cdiv(q_len, block_q))
    _prefill_kernel[(num_tiles, Hkv)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n, UPCAST=not q.is_cuda,
        num_warps=num_warps or (8 if block_q * group_pad >= 128 else 4), num_stages=num_stages or 3)
    return out
