"""Paged decode attention in Triton (split-KV, flash-decoding), and the online-softmax tile that
prefill_attention.py shares.

GQA: the query heads that share one KV head are packed into the M rows of one tl.dot, so each
K/V tile is read once per KV head and the tensor cores do the products. Layouts: see reference.py.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from . import pdl
from .arrivals import counters
from .kv_cache import cache_value
from .rope import rope_and_write_kv, rotate_tile

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_k, kv_head_v, tok0,
                 key_limit, kv_end, qk_scale, stride_kb, stride_ko, stride_vb, stride_vo, offs_d, d_mask,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """One online-softmax step over keys tok0 .. tok0+BLOCK_N of one sequence.

    key_limit [M]: last key position each row may see (causal); kv_end: keys at or past it are not
    loaded. MASK=False for tiles known to be fully visible to every row (no predicates at all).
    """
    offs_n = tok0 + tl.arange(0, BLOCK_N)
    if MASK:
        n_mask = offs_n < kv_end
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)  # num_blocks * block stride can pass 2**31 elements
    in_block = offs_n % BLOCK_SIZE
    k_rows = block_ids * stride_kb + in_block * stride_ko + kv_head_k
    v_rows = block_ids * stride_vb + in_block * stride_vo + kv_head_v
    if MASK:
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    # to q's type: an e4m3 cache's tiles widen in registers, to fp16 (dot_operand: one instruction a pair), and
    # under the interpreter (UPCAST) q is fp32, as it mishandles half-precision arithmetic
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [M, BLOCK_N], log2 domain
    if MASK:
        visible = (offs_n[None, :] <= key_limit[:, None]) & (offs_n[None, :] < kv_end)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASK:
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)  # accumulate in place (wgmma's accumulator on Hopper)
    return acc, m_new, l_i


@triton.jit
def dot_operand(q, cache_ptr):
    """q in the type the attention dots take over the cache at cache_ptr: fp16 over an e4m3 cache, whose tiles then
    widen in one instruction a pair (e4m3 -> bf16 takes several on Hopper); fp32 (the interpreter's) stays."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        if q.dtype != tl.float32:
            q = q.to(tl.float16)
    return q


# ---------------------------------------------------------------- decode


# one compile for every batch: stride_bt is the block table's width, which changes from step to step
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   arrivals_ptr, qk_scale, num_splits,
                   stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                   stride_bt, stride_ob, stride_oh,
                   k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, stride_knb, stride_knh,
                   stride_vnb, stride_vnh, stride_cs, prefix_lens_ptr, prefix_acc_ptr, prefix_ml_ptr,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr,
                   MERGE_GROUP: tl.constexpr, SPLITS_PAD: tl.constexpr, UPCAST: tl.constexpr,
                   ROPE: tl.constexpr, HALF_ROT: tl.constexpr, PDL: tl.constexpr, PREFIX: tl.constexpr):
    """Program (seq, kv_head, split): the GROUP query heads of one KV head over one slice of its keys.

    ROPE: q and this step's k, v come before RoPE and the cache write. Every program rotates its q; the
    program whose slice holds the last key rotates the new k and writes k, v to the token's slot (-1:
    padding, no write) before reading its keys, so a decode layer needs no RoPE launch of its own.

    MERGE (with SPLIT): the last split of a (seq, kv_head) to finish merges all of its splits' partials,
    so the step needs no reduce launch. arrivals[seq, kv_head] counts finished splits; the merging
    program sets it back to 0 for the next launch (a CUDA graph replays the same buffer). H200, 8B shape,
    same process: decode step at batch 1 / 4 / 8 4.406 / 4.551 / 4.803 -> 4.378 / 4.535 / 4.782 ms.
    PDL: launched with programmatic dependent launch (kernels/pdl.py): wait for the kernel ahead first.
    PREFIX (one split, no RoPE): each sequence's first prefix_lens[seq] keys were attended already by the
    shared-prefix launch (kernels/cascade.py), which left its partial in prefix_acc / prefix_ml; this program
    reads only the keys after them and merges that partial into its own.
    """
    if PDL:
        tl_cuda.gdc_wait()
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence cuts its own keys into num_splits slices of whole tiles, from its length on the
    # device: a CUDA graph captured once serves every context, and short sequences leave splits empty.
    if PREFIX:
        prefix_len = tl.load(prefix_lens_ptr + seq)
        start = prefix_len
        end = seq_len
    else:
        tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + seq * stride_qb + heads * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if ROPE:
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq) * stride_cs
        q = rotate_tile(q, q_rows, g_mask, cos_sin_row, offs_d, HALF_ROT)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if (end == seq_len) & (start < end) & (slot >= 0):
            one = tl.arange(0, 1)
            k_rows = k_new_ptr + seq * stride_knb + (kv_head + one) * stride_knh
            k = tl.load(k_rows[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
            k = rotate_tile(k, k_rows, one < 1, cos_sin_row, offs_d, HALF_ROT)
            v = tl.load(v_new_ptr + seq * stride_vnb + kv_head * stride_vnh + offs_d, mask=d_mask)
            block, in_block = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_cache_ptr + block * stride_kb + in_block * stride_ko + kv_head * stride_kh + offs_d[None, :],
                     cache_value(k, k_cache_ptr), mask=d_mask[None, :])
            tl.store(v_cache_ptr + block * stride_vb + in_block * stride_vo + kv_head * stride_vh + offs_d,
                     cache_value(v, v_cache_ptr), mask=d_mask)
        tl.debug_barrier()  # this block's threads read the new key and value only after they are stored
    if UPCAST:
        q = q.to(tl.float32)
    q = dot_operand(q, k_cache_ptr)  # fp16 over an e4m3 cache

    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    key_limit = tl.full([GROUP_PAD], 0, dtype=tl.int32) + end - 1
    block_table = block_tables_ptr + seq * stride_bt
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for tok0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head * stride_kh,
                                     kv_head * stride_vh, tok0, key_limit, end, qk_scale, stride_kb, stride_ko,
                                     stride_vb, stride_vo, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False)
    if full_end < end:
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table, kv_head * stride_kh,
                                     kv_head * stride_vh, full_end, key_limit, end, qk_scale, stride_kb, stride_ko,
                                     stride_vb, stride_vo, offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:  # unnormalised partials; an empty slice leaves m = -inf, l = 0, acc = 0
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [B, H, splits] flattened
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
        if MERGE:
            # Every thread's partial stores come before the release below (the barrier), and the merging
            # program's acquire makes all splits' partials visible to it; it reads them past L1 (.cg).
            tl.debug_barrier()
            counter = arrivals_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
                tl.store(counter, 0)
                _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq * stride_ob, kv_head * GROUP,
                              seq * GROUP * tl.num_programs(1), num_splits, stride_oh, GROUP, HEAD_DIM, HEAD_DIM_PAD,
                              MERGE_GROUP, SPLITS_PAD)
    else:
        if PREFIX:  # the shared prefix's partial: empty (m = -inf, l = 0) where the sequence has none
            row = seq * GROUP * tl.num_programs(1) + heads
            has = g_mask & (offs_g * 0 + prefix_len > 0)  # a tensor: the interpreter takes no scalar in a mask
            m_p = tl.load(prefix_ml_ptr + row * 2, mask=has, other=float("-inf"))
            l_p = tl.load(prefix_ml_ptr + row * 2 + 1, mask=has, other=0.0)
            acc_p = tl.load(prefix_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                            mask=has[:, None] & d_mask[None, :], other=0.0)
            m_new = tl.maximum(m_i, m_p)  # m_i is finite: the step's own key is always after the prefix
            alpha, beta = tl.exp2(m_i - m_new), tl.exp2(m_p - m_new)
            acc = acc * alpha[:, None] + acc_p * beta[:, None]
            l_i = l_i * alpha + l_p * beta
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, out_offset, head0, seq_head0, num_splits, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE_GROUP: tl.constexpr,
                  SPLITS_PAD: tl.constexpr):
    """out[heads head0 .. head0+GROUP] = the split partials merged with their max-logit rescale; all splits
    at once ([heads, splits, dim] in registers), not one after another, so it costs one round of loads."""
    offs_h = tl.arange(0, MERGE_GROUP)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    hs_mask = (offs_h[:, None] < GROUP) & (offs_s[None, :] < num_splits)
    rows = (seq_head0 + head0 + offs_h)[:, None] * num_splits + offs_s[None, :]  # [heads, splits]
    m_s = tl.load(part_ml_ptr + rows * 2, mask=hs_mask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_ml_ptr + rows * 2 + 1, mask=hs_mask, other=0.0, cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + rows[:, :, None] * HEAD_DIM_PAD + offs_d[None, None, :],
                  mask=hs_mask[:, :, None] & (offs_d[None, None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_s, axis=1)
    w = tl.exp2(m_s - m_max[:, None])  # empty splits: exp2(-inf) = 0 (padded heads give NaN, never stored)
    out = tl.sum(acc * w[:, :, None], axis=1) / tl.sum(l_s * w, axis=1)[:, None]
    heads = head0 + offs_h
    tl.store(out_ptr + out_offset + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(offs_h[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits, num_heads, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (seq, head): the merge as a launch of its own, where the decode kernel cannot merge."""
    seq, head = tl.program_id(0), tl.program_id(1)
    _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq * stride_ob, head, seq * num_heads, num_splits, stride_oh,
                  1, HEAD_DIM, HEAD_DIM_PAD, 2, SPLITS_PAD)


def decode_config(num_seqs, num_kv_heads, fp8_cache=False):
    """(num_splits, block_n, num_warps) for a decode batch, from its size alone (so a CUDA graph captured
    for a batch size is right at every context).

    Swept on the H200 (benchmarks/decode_profile.py, 32 layers replayed in a graph): the (sequence, KV head,
    split) programs should number about 256. Batch 1 at context 1k: 1 split 22.7 us, 16 splits 7.1 us;
    batch 8: 4 splits (16.5 us at 1k, 41.0 at 4k); batch 32 and up: no split. 128-key tiles won from
    batch 8 to 32 (batch 32 at 1k: 38.7 us against 44.1); from batch 64 the 64-key tile measured best
    (docs/benchmarks-kernels.md). 4 warps everywhere: the split 128-key tiles had 8 until a same-process
    A/B in the engine (decode step at batch 8 / 16, context 640: 4.629 / 4.839 -> 4.583 / 4.809 ms).
    An e4m3 cache (fp8_cache) takes 128-key tiles from batch 8 up: the same bytes as 64 bf16 keys. H100, one layer
    at batch 64, context 640: 50.0 us at 64 keys, 40.9 at 128, against a bf16 cache's 58.5 (docs/benchmarks.md,
    "An fp8 KV cache").
    """
    programs = num_seqs * num_kv_heads
    num_splits = 1
    while num_splits < 16 and programs * num_splits * 2 <= 256:
        num_splits *= 2
    return num_splits, 128 if 8 <= num_seqs and (fp8_cache or num_seqs < 64) else 64, 4


# RoPE inside the decode launch, H200, 8B shape, same process, decode step at context 640 (ms): batch 1 / 8 / 16 / 32
# 4.245 / 4.530 / 4.742 / 5.472 -> 4.195 / 4.457 / 4.653 / 5.413; but batch 64 / 128 / 256, unsplit, with every
# program a writer, 6.065 / 7.741 / 12.058 -> 6.463 / 8.014 / 12.706.
ROPE_MAX_BATCH = 64


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, max_seq_len=None, out=None,
                           num_splits=None, block_n=None, num_warps=None, num_stages=None, merge=True, new_kv=None,
                           pdl_chain=False, prefix=None):
    """q [B, H, D] (one token per sequence) -> [B, H, D]. seq_lens / block_tables stay on the device.

    max_seq_len is accepted for symmetry with the prefill launcher: every sequence sizes its own splits.
    merge=True: split partials are merged by the last split to finish, not by a second launch.
    new_kv=(k, v, positions, cos_sin_cache, slot_mapping): q and k [B, Hkv, D] are before RoPE, and this
    launch also does rope_and_write_kv's work (the new keys are the last of seq_lens). Below ROPE_MAX_BATCH
    sequences; from there rope_and_write_kv runs first, as its own launch.
    pdl_chain: the kernel ahead of this one is launched with programmatic dependent launch too (our GEMV,
    kernels/pdl.py): launch this one that way (not after rope_and_write_kv).
    prefix=(prefix_lens, acc, ml): the keys before prefix_lens[b] were attended by cascade.py's shared-prefix
    launch, whose partials these are; q must be rotated already (new_kv None) and the launch is not split.
    """
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    rope_first = new_kv is not None and B >= ROPE_MAX_BATCH
    use_pdl = pdl_chain and not rope_first and pdl.active(q)
    if rope_first:
        k_new, v_new, positions, cos_sin, slots = new_kv
        q, new_kv = rope_and_write_kv(q, k_new, v_new, positions, cos_sin, k_cache, v_cache, slots), None
    auto_splits, auto_block_n, auto_warps = decode_config(B, Hkv, k_cache.element_size() == 1)
    num_splits = 1 if prefix is not None else num_splits or auto_splits
    assert prefix is None or new_kv is None, "the shared-prefix launch needs q rotated already"
    block_n = block_n or (auto_block_n if D <= 128 else 32)
    split = num_splits > 1
    d_pad = triton.next_power_of_2(D)
    arrivals = counters(q.device, B * Hkv) if split and merge else None
    if split:
        part_acc = torch.empty(B * H * num_splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * H * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    if new_kv is None:
        k_new, v_new, positions, cos_sin, slots = q, q, seq_lens, q, seq_lens  # unused
    else:
        k_new, v_new, positions, cos_sin, slots = new_kv
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and cos_sin.shape[-1] <= D
    _decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml,
        arrivals if arrivals is not None else seq_lens, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        k_new, v_new, positions, cos_sin, slots, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos_sin.stride(0), *(prefix if prefix is not None else (seq_lens, out, out)), PREFIX=prefix is not None,
        ROPE=new_kv is not None, HALF_ROT=cos_sin.shape[-1] // 2 if new_kv is not None else 1,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, HEAD_DIM_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, MERGE=arrivals is not None,
        MERGE_GROUP=max(2, triton.next_power_of_2(group)), SPLITS_PAD=splits_pad, UPCAST=not q.is_cuda,
        PDL=use_pdl, launch_pdl=use_pdl, num_warps=num_warps or auto_warps, num_stages=num_stages or 2)
    if split and arrivals is None:
        _decode_reduce_kernel[(B, H)](part_acc, part_ml, out, num_splits, H, out.stride(0), out.stride(1),
                                      HEAD_DIM=D, HEAD_DIM_PAD=d_pad, SPLITS_PAD=splits_pad, num_warps=4)
    return out
