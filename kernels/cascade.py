"""Cascade decode attention: sequences that share a prompt's KV blocks (the n samples of one prompt, copy-on-write)
read the shared prefix once for the whole group, then each its own keys, and the two partial softmaxes merge.

The shared-prefix launch packs up to SAMPLES sequences x the query heads of one KV head into the M rows of one dot
(16 samples x 4 heads = 64 rows for Llama-3.1-8B), so each prefix tile is loaded once per group and KV head where
the decode kernel loads it once per sequence. It leaves an unnormalised partial (acc, max, sum) per sequence and
head; attention.py's decode kernel then reads each sequence's keys past the prefix and merges that partial in
(its PREFIX mode). Groups come from the block tables (worker/executor/step_inputs.py, shared_prefix_groups): a
group is a run of rows whose tables start with the same blocks. Layouts: see reference.py.
"""
import math

import torch
import triton
import triton.language as tl

from .attention import LOG2E, _attend_tile, dot_operand, paged_decode_attention

GROUP_ROWS = 64  # M rows of the shared-prefix dot: samples of a group x query heads of a KV head


def samples_per_program(num_heads: int, num_kv_heads: int) -> int:
    """Sequences one shared-prefix program serves: a group with more is cut into runs of this many."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, GROUP_ROWS // group_pad)


# one compile for every batch: stride_bt is the block table's width, which changes from step to step
@triton.jit(do_not_specialize=["stride_bt"])
def _prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, groups_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                   stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SAMPLES: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Program (group, kv_head): the group's sequences x the KV head's query heads over the group's shared keys.

    groups [G, 3] int32: first row, rows, shared prefix tokens (a multiple of the block size; rows < 2 or
    0 tokens: nothing to do, so a CUDA graph can launch a fixed grid over padded groups).
    """
    g, kv_head = tl.program_id(0), tl.program_id(1)
    first = tl.load(groups_ptr + g * 3)
    size = tl.load(groups_ptr + g * 3 + 1)
    prefix_len = tl.load(groups_ptr + g * 3 + 2)
    if (size > 1) & (prefix_len > 0):
        rows = tl.arange(0, SAMPLES * GROUP_PAD)
        sample, head_in_group = rows // GROUP_PAD, rows % GROUP_PAD
        valid = (sample < size) & (head_in_group < GROUP)
        seq = first + sample
        heads = kv_head * GROUP + head_in_group
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + seq[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q = dot_operand(q, k_cache_ptr)  # fp16 over an e4m3 cache
        acc = tl.full([SAMPLES * GROUP_PAD, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
        m_i = tl.full([SAMPLES * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.full([SAMPLES * GROUP_PAD], 0.0, dtype=tl.float32)
        key_limit = tl.full([SAMPLES * GROUP_PAD], 0, dtype=tl.int32) + prefix_len - 1
        block_table = block_tables_ptr + first * stride_bt  # the group's first row: its prefix blocks are everyone's
        full_end = prefix_len // BLOCK_N * BLOCK_N
        for tok0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table,
                                         kv_head * stride_kh, kv_head * stride_vh, tok0, key_limit, prefix_len,
                                         qk_scale, stride_kb, stride_ko, stride_vb, stride_vo, offs_d, d_mask,
                                         BLOCK_SIZE, BLOCK_N, False)
        if full_end < prefix_len:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table,
                                         kv_head * stride_kh, kv_head * stride_vh, full_end, key_limit, prefix_len,
                                         qk_scale, stride_kb, stride_ko, stride_vb, stride_vo, offs_d, d_mask,
                                         BLOCK_SIZE, BLOCK_N, True)
        row = seq * GROUP * tl.num_programs(1) + heads  # [B, H] flattened, as the decode kernel reads it
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=valid[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=valid)


def cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, groups, prefix_lens, scale=None, out=None,
                             block_n=None, num_warps=None):
    """q [B, H, D] (rotated, one token per sequence, already in the cache) -> [B, H, D].

    groups [G, 3] int32 on the device: (first row, rows, shared prefix tokens) of each group, rows at most
    samples_per_program(H, Hkv); prefix_lens [B] int32: each row's group's prefix tokens (0: none). Two launches:
    the shared prefixes, then the decode kernel over each row's own keys, merging the prefix partials.
    """
    (B, H, D), Hkv = q.shape, k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    d_pad = triton.next_power_of_2(D)
    part_acc = torch.empty(B * H, d_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B * H, 2, dtype=torch.float32, device=q.device)
    if groups.shape[0]:  # the decode launch below checks the layouts
        _prefix_kernel[(groups.shape[0], Hkv)](
            q, k_cache, v_cache, block_tables, groups, part_acc, part_ml, scale * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            GROUP=H // Hkv, GROUP_PAD=triton.next_power_of_2(H // Hkv), SAMPLES=samples_per_program(H, Hkv),
            HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n or (64 if D <= 128 else 32),
            UPCAST=not q.is_cuda, num_warps=num_warps or (4 if D <= 128 else 8))
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, out=out,
                                  prefix=(prefix_lens, part_acc, part_ml))
