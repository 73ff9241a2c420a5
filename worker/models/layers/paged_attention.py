"""Paged attention as a layer: rotate q/k, write this step's K/V into the cache, attend through the block tables.

The step's metadata (slot mapping, block tables, sequence lengths, query offsets) is entered once per
forward by the model runner (models/layers/context.py); every layer reads the same context, as nano-vllm does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.context import get_forward_context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 = padding
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs], cached tokens after this step's write
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    max_seq_len: int  # host copy of seq_lens.max(), so kernels need no device sync
    is_decode: bool  # every sequence has exactly one new token
    num_decodes: int = 0  # mixed steps: the leading sequences with one new token (decode kernel)
    # mixed steps: the prompt chunks' own metadata (offsets from 0), in 16-byte-aligned device buffers
    prefill_block_tables: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_cu_seqlens_q: torch.Tensor | None = None
    # models with recurrent layers: each sequence's state slot, in batch order (-1: a padding row); None without
    state_slots: torch.Tensor | None = None
    # pure decode steps whose rows share their first blocks (the samples of one prompt): (groups [G, 3], each
    # row's prefix tokens [n]) on the device, step_inputs.shared_prefix_groups; None: no cascade this step
    cascade: tuple[torch.Tensor, torch.Tensor] | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner after the KV cache is sized: views into one big allocation.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, pdl_chain: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], before RoPE -> [T, H * D]. pdl_chain: see ops.paged_decode_attention."""
        meta = get_forward_context().attention
        if not self.k_cache.numel():  # the profiling run has no cache
            q, k = ops.apply_rope(q, k, positions, cos_sin_cache)
            out = _attend_without_cache(q, k, v, meta, self.scale)
        elif meta.cascade is not None:
            # the samples of a prompt read its blocks once a group (kernels/cascade.py), so RoPE and the cache
            # write go first, as they do from ROPE_MAX_BATCH rows anyway
            q = ops.rope_and_write_kv(q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping)
            out = ops.cascade_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                               self.scale, meta.max_seq_len, *meta.cascade)
        elif meta.is_decode:
            # RoPE, the cache write and the attention in one launch: each new key is its sequence's last
            out = ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                             self.scale, meta.max_seq_len, eager_step=True,
                                             new_kv=(k, v, positions, cos_sin_cache, meta.slot_mapping),
                                             pdl_chain=pdl_chain)
        else:
            # RoPE and the cache write are one kernel: the rotated keys go straight to their slots
            q = ops.rope_and_write_kv(q, k, v, positions, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping)
            if meta.num_decodes:
                out = self._mixed(q, meta)
            else:
                out = ops.paged_prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                                  meta.cu_seqlens_q, self.scale, meta.max_seq_len)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _mixed(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decodes and prompt chunks in one step: each part through its own kernel. The prefill kernel
        would give every decode a whole query tile (32 tokens x 4 heads for one useful token)."""
        nd = meta.num_decodes
        out = torch.empty_like(q)
        ops.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                   self.scale, meta.max_seq_len, out=out[:nd])
        ops.paged_prefill_attention(q[nd:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                                    meta.prefill_seq_lens, meta.prefill_cu_seqlens_q, self.scale, meta.max_seq_len,
                                    out=out[nd:])
        return out


def _attend_without_cache(q, k, v, meta, scale):
    """Memory-profiling pass before the cache exists: causal attention within each packed sequence."""
    out = torch.empty_like(q)
    starts = meta.cu_seqlens_q.tolist()
    group = q.shape[1] // k.shape[1]
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out
