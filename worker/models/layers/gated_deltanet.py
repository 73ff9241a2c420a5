"""Gated DeltaNet (Qwen3.5's linear attention) as a layer over per-sequence state slots.

One packed projection gives q, k, v (the conv channels), the output gate z and the rule's b and a; a causal
depthwise conv with SiLU runs over q, k, v continued from the slot's conv state; the gated delta rule runs
over the slot's recurrent state (chunked for prompt chunks, the recurrent step for decodes); a gated RMSNorm
and out_proj close it. Which tokens belong to which sequence, and each sequence's state slot, come from the
step's attention metadata (cu_seqlens_q, state_slots): states are read and updated in place, so chunked
prefill and mixed decode + prefill steps continue every sequence where its last step left it.
"""

from __future__ import annotations

import torch
from torch import nn

from pagefleet.worker.models.layers import ops, parallel
from pagefleet.worker.models.layers.context import get_forward_context
from pagefleet.worker.models.layers.linear import Linear
from pagefleet.worker.models.registry import ModelConfig


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = c.linear_conv_kernel_dim
        # [q k v | z | b | a]: one GEMM for the four checkpoint projections
        self.in_proj = Linear(c.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))  # depthwise, no bias
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)
        # Bound by bind_state_cache: this layer's views of the state cache, [slots, ...]
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def in_proj_sizes(self) -> dict[str, int]:
        """Rows of each checkpoint projection in the packed in_proj, in order."""
        return {"qkv": self.conv_dim, "z": self.value_dim, "b": self.num_v_heads, "a": self.num_v_heads}

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Per-slot (conv state, recurrent state) shapes and dtypes: the conv keeps its last K - 1 inputs in
        the model dtype, the rule its [Hv, Dk, Dv] state in fp32 here (the engine's cache may store it in bf16:
        model.state_shapes(ssm_dtype))."""
        return (((self.conv_dim, self.kernel_size - 1), dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attention
        T = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(list(self.in_proj_sizes().values()), dim=-1)
        nd = T if meta.is_decode else meta.num_decodes
        conv_state, ssm_state, slots = self._states(meta, x, nd)
        # The decodes lead the step (one token each, row i is sequence i); prompt chunks follow with their own
        # offsets from 0 (prefill_cu_seqlens_q in a mixed step)
        parts = []
        if nd:
            parts.append((slice(0, nd), slots[:nd], None))
        if nd < T:
            cu = meta.cu_seqlens_q if nd == 0 else meta.prefill_cu_seqlens_q
            parts.append((slice(nd, T), slots[nd:], cu))
        # one part (a pure decode or prompt step) is the whole output; a mixed step writes its two parts into one
        core = None if len(parts) == 1 else torch.empty(T, self.num_v_heads, self.head_v_dim, dtype=x.dtype,
                                                        device=x.device)
        for rows, part_slots, cu in parts:
            qkv = ops.causal_conv1d(mixed[rows], self.conv_weight, conv_state, part_slots, cu)
            q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            n = q.shape[0]
            q = q.view(n, self.num_k_heads, self.head_k_dim)
            k = k.view(n, self.num_k_heads, self.head_k_dim)
            v = v.view(n, self.num_v_heads, self.head_v_dim)
            if cu is None:
                o = ops.recurrent_gated_delta_rule(q, k, v, a[rows], b[rows], self.A_log, self.dt_bias, ssm_state,
                                                   part_slots)
            else:
                o = ops.chunk_gated_delta_rule(q, k, v, a[rows], b[rows], self.A_log, self.dt_bias, ssm_state,
                                               part_slots, cu)
            if core is None:
                core = o
            else:
                core[rows] = o
        out = self.norm(core, z.view(T, self.num_v_heads, self.head_v_dim))
        return parallel.all_reduce(self.out_proj(out.view(T, self.value_dim)))

    def _states(self, meta, x, nd):
        """(conv state, recurrent state, each sequence's slot). Without a bound cache (the memory-profiling
        run) the step's sequences get fresh zero states of their own, as PagedAttention attends without one."""
        slots = getattr(meta, "state_slots", None)  # AttentionMetadata.state_slots
        if self.ssm_state.numel():
            if slots is None:
                raise ValueError("a Gated DeltaNet layer needs the step's state_slots in its attention metadata")
            return self.conv_state, self.ssm_state, slots
        if slots is None:
            prompts = 0 if nd == x.shape[0] else (meta.prefill_cu_seqlens_q if nd else meta.cu_seqlens_q).shape[0] - 1
            slots = torch.arange(nd + prompts, dtype=torch.int32, device=x.device)
        else:  # padding rows (-1) stay padding; the others each get a scratch state of their own
            slots = torch.where(slots >= 0, torch.arange(slots.shape[0], dtype=torch.int32, device=x.device), -1)
        (conv_shape, conv_dtype), (ssm_shape, ssm_dtype) = self.state_shapes(x.dtype)
        n = slots.shape[0]
        return (torch.zeros(n, *conv_shape, dtype=conv_dtype, device=x.device),
                torch.zeros(n, *ssm_shape, dtype=ssm_dtype, device=x.device), slots)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(z) per value head (the weight is used as stored, no 1 + w)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)
