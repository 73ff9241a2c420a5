"""Qwen3.5 / Qwen3.6 text decoder: Gated DeltaNet layers over state slots, gated full attention over the paged KV cache.

layer_types picks each layer's token mixer. Full attention has the sigmoid output gate in q_proj (each head's
query then its gate), per-head q/k RMSNorm and partial RoPE; every RMSNorm but the DeltaNet's gated one scales
by 1 + weight, which loading folds into the stored weight. A multimodal checkpoint's text weights
(model.language_model.*) load; its vision tower and multi-token-prediction heads are skipped with a log line.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagefleet.worker.models.layers import ops, parallel
from pagefleet.worker.models.layers.gated_deltanet import GatedDeltaNet
from pagefleet.worker.models.layers.linear import Linear
from pagefleet.worker.models.layers.norm import RMSNorm
from pagefleet.worker.models.layers.paged_attention import PagedAttention
from pagefleet.worker.models.llama import MLP, DecoderModel, compute_logits
from pagefleet.worker.models.registry import ModelConfig


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attn_output_gate
        self.q_size = self.num_heads * self.head_dim * (2 if self.gated else 1)  # with the gate when gated
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.o_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.gated:  # per head: D query dims, then D gate dims
            q, gate = q.view(T, self.num_heads, 2 * D).split([D, D], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, D) if not self.gated else q)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        out = self.attn(q, k, v.view(T, self.num_kv_heads, D), positions, cos_sin_cache)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(T, self.num_heads * D))
        return parallel.all_reduce(self.o_proj(out))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions, hidden, residual, cos_sin_cache):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(hidden)
        else:
            hidden = self.self_attn(positions, hidden, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# checkpoint name piece -> (our name piece, shard)
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", "qkv"),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", "z"),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", "b"),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", "a"),
    "linear_attn.conv1d": ("linear_attn.conv_weight", "conv"),
}
_PACKED_RE = re.compile(r"\.(" + "|".join(re.escape(k) for k in _PACKED) + r")\.(weight|bias)$")
# RMSNorms that scale by 1 + weight: loaded as 1 + the checkpoint's tensor (shard OFFSET_NORM)
_OFFSET_NORM_RE = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|^model\.norm\.weight$")
OFFSET_NORM = "1+w"
# checkpoint parts this text model does not serve: prefix -> what the log line calls it
_SKIPPED = {"model.visual.": "vision tower", "mtp.": "multi-token-prediction heads"}


class Qwen3_5ForCausalLM(nn.Module):
    # the DeltaNet ops on CUDA (kernels/causal_conv1d.py, gdn_recurrent.py, gdn_chunk.py) make no host syncs and
    # skip slot -1 rows: every graph kind may capture this model's steps
    state_graphs = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layers=(DecoderLayer(config, t) for t in config.layer_types))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_sin_cache = torch.empty(0)
        self._skipped_logged: set[str] = set()

    # ---- forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = parallel.embed(self.model.embed_tokens, input_ids)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a buffer to write into (the decode graphs' static logits)."""
        return compute_logits(self.lm_head, hidden, out)

    # ---- the caches: paged KV for full attention, state slots for the DeltaNet layers

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    def deltanet_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if hasattr(layer, "linear_attn")]

    def state_shapes(self, ssm_dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shapes stacked over the DeltaNet layers: "conv" [L_lin, conv_dim, K - 1] in the model dtype,
        "ssm" [L_lin, Hv, Dk, Dv] in ssm_dtype (the engine's mamba_ssm_cache_dtype, resolved)."""
        layers = self.deltanet_layers()
        (conv, conv_dtype), (ssm, _) = layers[0].state_shapes(self.model.embed_tokens.weight.dtype)
        return {"conv": ((len(layers), *conv), conv_dtype), "ssm": ((len(layers), *ssm), ssm_dtype)}

    def bind_state_cache(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """conv [L_lin, slots, conv_dim, K - 1], ssm [L_lin, slots, Hv, Dk, Dv]: each layer keeps its views."""
        layers = self.deltanet_layers()
        if conv.shape[0] != len(layers) or ssm.shape[0] != len(layers):
            raise ValueError(f"state cache for {conv.shape[0]} / {ssm.shape[0]} layers, the model has {len(layers)}")
        for i, layer in enumerate(layers):
            layer.conv_state, layer.ssm_state = conv[i], ssm[i]

    # ---- weights

    def map_weight_name(self, name: str) -> tuple[str | None, object]:
        """Checkpoint tensor name -> (our parameter name, shard), or (None, None) to skip it."""
        for prefix, what in _SKIPPED.items():
            if name.startswith(prefix):
                if prefix not in self._skipped_logged:
                    self._skipped_logged.add(prefix)
                    print(f"pagefleet: skipping the checkpoint's {what} ({prefix}*): text generation only", flush=True)
                return None, None
        if "rotary_emb.inv_freq" in name:
            return None, None
        if name.startswith("model.language_model."):  # Qwen3_5ForConditionalGeneration nests the text model
            name = "model." + name[len("model.language_model."):]
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight", None
        m = _PACKED_RE.search(name)
        if m:
            ours, shard = _PACKED[m.group(1)]
            return name[: m.start(1)] + ours + ("" if shard == "conv" else "." + m.group(2)), shard
        if _OFFSET_NORM_RE.search(name):
            return name, OFFSET_NORM
        return name, None

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard: object) -> None:
        if shard == "conv":  # nn.Conv1d's depthwise [C, 1, K]
            tensor = tensor.squeeze(1)
        elif shard == OFFSET_NORM:
            tensor = tensor.float() + 1.0
        if shard in (None, "conv", OFFSET_NORM):
            if param.shape != tensor.shape:
                raise ValueError(f"weight shape {tuple(tensor.shape)} does not match parameter {tuple(param.shape)}")
            param.data.copy_(tensor)
            return
        offset, size = self._shard_rows(param, shard)
        if tensor.shape[0] != size:
            raise ValueError(f"packed shard {shard} has {tensor.shape[0]} rows, expected {size}")
        param.data.narrow(0, offset, size).copy_(tensor)

    def _shard_rows(self, param: nn.Parameter, shard: object) -> tuple[int, int]:
        c = self.config
        if shard in (0, 1):
            return shard * c.intermediate_size, c.intermediate_size
        if shard in ("q", "k", "v"):
            q = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
            kv = c.num_key_value_heads * c.head_dim
            return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        sizes = self.deltanet_layers()[0].in_proj_sizes()
        names = list(sizes)
        return sum(sizes[n] for n in names[: names.index(shard)]), sizes[shard]

    def expected_weights(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.endswith(".qkv_proj.weight") or name.endswith(".qkv_proj.bias"):
                names += [f"{name}:{s}" for s in ("q", "k", "v")]
            elif name.endswith(".gate_up_proj.weight"):
                names += [f"{name}:{s}" for s in (0, 1)]
            elif name.endswith(".in_proj.weight"):
                names += [f"{name}:{s}" for s in ("qkv", "z", "b", "a")]
            elif name.endswith(".conv_weight"):
                names.append(f"{name}:conv")
            elif _OFFSET_NORM_RE.search(name):
                names.append(f"{name}:{OFFSET_NORM}")
            else:
                names.append(name)
        return names

    def tie_weights_if_needed(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def post_load(self, device: torch.device) -> None:
        c = self.config
        rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        self.cos_sin_cache = ops.rope_cos_sin_cache(rotary_dim, c.max_position_embeddings, c.rope_theta,
                                                    c.rope_scaling, torch.float32, device)
