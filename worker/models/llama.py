"""Llama-family decoder (Llama 2/3 with llama3 RoPE scaling, SmolLM2, Mistral) over the paged KV cache.

q/k/v and gate/up are packed into one GEMM each; checkpoint tensors are mapped into their shards.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagefleet.worker.models.layers import ops, parallel
from pagefleet.worker.models.layers.linear import Linear
from pagefleet.worker.models.layers.norm import RMSNorm
from pagefleet.worker.models.layers.paged_attention import PagedAttention
from pagefleet.worker.models.registry import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None  # Qwen3
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        return parallel.all_reduce(self.o_proj(self.attend(positions, self.qkv_proj(x), cos_sin_cache)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, cos_sin_cache: torch.Tensor,
               pdl_chain: bool = False) -> torch.Tensor:
        """Packed q/k/v projections -> attention output [T, H * D], before o_proj. pdl_chain: qkv comes
        straight from our GEMV (ops.paged_decode_attention)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn(q, k, v, positions, cos_sin_cache, pdl_chain and self.q_norm is None)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, fp8_rows: bool = False) -> torch.Tensor:
        """down_proj's partial sums all-reduced across tensor-parallel ranks (a no-op on one)."""
        gate_up = self.gate_up_proj
        if fp8_rows:  # x came quantised; so does the activation's output, for down's FP8 GEMM
            act = ops.silu_and_mul_fp8(gate_up(x))
        elif gate_up.lora is None:  # no adapter: the activation can fuse into the decode GEMV
            act = ops.linear_silu_and_mul(x, gate_up.weight, gate_up.bias, weight_scale=gate_up.weight_scale)
        else:
            act = ops.silu_and_mul(gate_up(x))
        return parallel.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions, hidden, residual, cos_sin_cache, fp8_rows: bool = False):
        """fp8_rows: the linears are e4m3 GEMMs; the norms and the activation quantise their outputs for them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, fp8=fp8_rows)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, fp8=fp8_rows)
        hidden = self.self_attn(positions, hidden, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual, fp8=fp8_rows)
        return self.mlp(hidden, fp8_rows), residual

    def forward_folded(self, positions, residual, sumsq, cos_sin_cache):
        """This layer with its norms folded (LlamaForCausalLM.fold_norms) and no norm launches: the stream
        and its rows' partial sums of squares in, the same out. The GEMVs that read a norm scale their
        rows by its rstd; the GEMVs that add into the stream leave the sums behind."""
        qkv_proj, o_proj = self.self_attn.qkv_proj, self.self_attn.o_proj
        gate_up, down = self.mlp.gate_up_proj, self.mlp.down_proj
        qkv = ops.linear_normed(residual, qkv_proj.weight, qkv_proj.bias, sumsq, self.input_layernorm.eps,
                                qkv_proj.weight_scale)
        out = self.self_attn.attend(positions, qkv, cos_sin_cache, pdl_chain=True)
        residual, sumsq = ops.linear_add(out, o_proj.weight, o_proj.bias, residual, o_proj.weight_scale)
        act = ops.linear_silu_and_mul(residual, gate_up.weight, gate_up.bias, sumsq, self.post_attention_layernorm.eps,
                                      gate_up.weight_scale)
        return ops.linear_add(act, down.weight, down.bias, residual, down.weight_scale)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False, layers=None):
        """layers: the decoder layers of another architecture (Qwen3.5's hybrid ones); default Llama's."""
        super().__init__()
        # an explicit (meta) weight skips nn.Embedding's random init, whose normal_ on the meta device imports
        # torch._dynamo (1.8-2.3 s of start-up); the loader overwrites the weight anyway
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        if layers is None:
            layers = (DecoderLayer(config, qk_norm) for _ in range(config.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def compute_logits(lm_head: Linear, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """lm_head over the final hidden states; out: a buffer to write into (the decode graphs' static logits)."""
    if parallel.get_tensor_parallel().size > 1:
        return parallel.gather_logits(ops.linear(hidden, lm_head.weight, lm_head.bias), out)
    if out is None:
        return lm_head(hidden)
    return ops.linear(hidden, lm_head.weight, lm_head.bias, out=out)


# checkpoint name pieces -> (our name piece, shard)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    norms_folded = False  # fold_norms() ran
    fp8_weights = False  # layers/fp8.py made the decoder linears e4m3
    # norms and activation quantise for the e4m3 GEMMs after them (False: the GEMMs do)
    fuse_fp8_quantisation = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_sin_cache = torch.empty(0)

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-KV layers, in order (the KV cache binds one layer of blocks to each)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    # ---- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.norms_folded and ops.skinny_rows(input_ids, self.fp8_weights):  # norms fold only in half precision
            return self.forward_folded(input_ids, positions)
        hidden = parallel.embed(self.model.embed_tokens, input_ids)
        residual = None
        # e4m3 linears that are GEMMs here (not the decode GEMV): rows reach them quantised by the kernel before
        fp8_rows = self.fp8_weights and self.fuse_fp8_quantisation and not ops.skinny_rows(hidden, True)
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, fp8_rows)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def forward_folded(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step's forward with the decoder norms folded: token ids -> final hidden states. Of the
        norms only the final one launches (the H200 profile at batch 1 had 64 norm launches of ~2.2 us a
        step); the embeddings come with their sums of squares, which the first GEMV normalises by."""
        residual, sumsq = ops.embed_rows(input_ids, self.model.embed_tokens.weight)
        for layer in self.model.layers:
            residual, sumsq = layer.forward_folded(positions, residual, sumsq, self.cos_sin_cache)
        return self.model.norm(residual)

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Multiply each decoder norm's weight into the columns of the linear that reads its output (qkv,
        gate_up) and set it to 1. The model computes the same function (to bf16 rounding) on every path,
        and forward_folded can apply a norm as a row scale inside the next GEMV. Not with LoRA: adapters
        read the norm's output with its weight. The final norm stays: lm_head may share the embeddings."""
        for norm, linear in self.norm_linear_pairs():
            # in place, with no fp32 copy of gate_up (470 MB at 8B): torch rounds the product once either way
            linear.weight.mul_(norm.weight)
            norm.unfolded_weight = norm.weight.clone()  # what a weight update folds in again (loader.apply_weights)
            norm.weight.fill_(1.0)
        self.norms_folded = True

    def norm_linear_pairs(self):
        """(norm, linear) for each decoder norm and the linear that reads its output: what fold_norms folds."""
        for layer in self.model.layers:
            yield layer.input_layernorm, layer.self_attn.qkv_proj
            yield layer.post_attention_layernorm, layer.mlp.gate_up_proj

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a buffer to write into (the decode graphs' static logits). Tensor-parallel: each rank's slice of
        the vocabulary, gathered."""
        return compute_logits(self.lm_head, hidden, out)

    # ---- weights

    def map_weight_name(self, name: str) -> tuple[str | None, object]:
        """Checkpoint tensor name -> (our parameter name, shard), or (None, None) to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None, None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            # a tied checkpoint may keep only this copy (safetensors drops one of two shared tensors)
            return "model.embed_tokens.weight", None
        m = _PACKED_RE.search(name)
        if m:
            ours, shard = _PACKED[m.group(1)]
            return name.replace(f".{m.group(1)}.", f".{ours}."), shard
        return name, None

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard: object) -> None:
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(f"weight shape {tuple(tensor.shape)} does not match parameter {tuple(param.shape)}")
            param.data.copy_(tensor)
            return
        offset, size = self.shard_rows(shard)
        if tensor.shape != (size, *param.shape[1:]):
            raise ValueError(f"packed shard {shard} has shape {tuple(tensor.shape)}, expected "
                             f"{(size, *param.shape[1:])}")
        param.data.narrow(0, offset, size).copy_(tensor)

    def shard_rows(self, shard: object) -> tuple[int, int]:
        """(first row, rows) of a packed shard in its parameter (q / k / v of qkv_proj, 0 / 1 of gate_up_proj)."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), 0: (0, inter), 1: (inter, inter)}[shard]

    def expected_weights(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if ".qkv_proj." in name:
                names += [f"{name}:{s}" for s in ("q", "k", "v")]
            elif ".gate_up_proj." in name:
                names += [f"{name}:{s}" for s in (0, 1)]
            else:
                names.append(name)
        return names

    def tie_weights_if_needed(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def post_load(self, device: torch.device) -> None:
        c = self.config
        self.cos_sin_cache = ops.rope_cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                                    c.rope_scaling, torch.float32, device)
