"""Model configs read from config.json and the registry of architectures we serve."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# architecture name in config.json -> (module, class)
_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3ForCausalLM"),
    # Qwen3.5 / 3.6: the text model only (a vision tower's tensors are skipped)
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = frozenset(_REGISTRY)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    # hybrid models (Qwen3.5): "linear_attention" (Gated DeltaNet) or "full_attention" per layer; None: all full
    layer_types: list[str] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output
    mamba_ssm_dtype: str | None = None  # the recurrent state's dtype the checkpoint asks for (Qwen3.5's configs)

    def twin(self, num_layers: int = 2) -> ModelConfig:
        """The same model cut to `num_layers` layers, for the compile workers' twin. A hybrid keeps one layer
        of each mixer it has (its first DeltaNet layer, then its first full-attention layer), so the twin
        compiles both mixers' kernels and holds one layer's recurrent state per slot, not 48."""
        if self.layer_types is None:
            return replace(self, num_hidden_layers=min(num_layers, self.num_hidden_layers))
        kinds = [k for k in ("linear_attention", "full_attention") if k in self.layer_types]
        if len(kinds) == 1:
            kinds = kinds * min(num_layers, self.num_hidden_layers)
        return replace(self, num_hidden_layers=len(kinds), layer_types=kinds)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict) -> ModelConfig:
        arch = next(a for a in raw["architectures"] if a in _REGISTRY)
        outer = raw
        if isinstance(raw.get("text_config"), dict):  # a multimodal checkpoint: the text model's own config
            raw = {"dtype": outer.get("dtype") or outer.get("torch_dtype"),
                   **{k: outer[k] for k in ("mamba_ssm_dtype",) if k in outer}, **raw["text_config"],
                   **{k: outer[k] for k in ("tie_word_embeddings",) if k in outer}}
        heads = raw["num_attention_heads"]
        # transformers 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
        rope.pop("rope_theta", None)
        # Qwen3.5 keeps the partial rotary factor among the rope parameters, beside its multimodal (M-RoPE)
        # sections, which every text position fills alike: text-only, that is plain RoPE
        partial_rotary = rope.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor")
        partial_rotary = float(partial_rotary or (0.25 if arch.startswith("Qwen3_5") else 1.0))
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attention_bias = bool(raw.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=theta,
            rope_scaling=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,  # Qwen2 always has q/k/v bias
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            eos_token_ids=eos_ids,
            **_hybrid_fields(arch, raw, partial_rotary),
        )


def _hybrid_fields(arch: str, raw: dict, partial_rotary: float) -> dict:
    if not arch.startswith("Qwen3_5"):
        return {"partial_rotary_factor": partial_rotary}
    layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:  # transformers' default: every full_attention_interval-th layer is full attention
        interval = raw.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types must name linear_attention or full_attention for each of {layers} layers, "
                         f"got {layer_types}")
    return dict(
        layer_types=list(layer_types),
        linear_num_key_heads=raw.get("linear_num_key_heads", 16),
        linear_num_value_heads=raw.get("linear_num_value_heads", 32),
        linear_key_head_dim=raw.get("linear_key_head_dim", 128),
        linear_value_head_dim=raw.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        partial_rotary_factor=partial_rotary,
        attn_output_gate=bool(raw.get("attn_output_gate", True)),  # Qwen3.5's attention always has the gate
        mamba_ssm_dtype=raw.get("mamba_ssm_dtype"),
    )


def model_class(architecture: str):
    import importlib

    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(f"pagefleet.worker.models.{module}"), name)
