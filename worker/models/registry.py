"""Model configs read from config.json and the registry of architectures we serve."""

from __future__ import annotations

from dataclasses import dataclass, field

# architecture name in config.json -> (module, class)
_REGISTRY = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3ForCausalLM"),
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

    @classmethod
    def from_dict(cls, raw: dict, generation: dict) -> ModelConfig:
        arch = next(a for a in raw["architectures"] if a in _REGISTRY)
        heads = raw["num_attention_heads"]
        # transformers 5 writes rope_parameters (theta inside); older checkpoints rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
        rope.pop("rope_theta", None)
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
        )


def model_class(architecture: str):
    import importlib

    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(f"pagefleet.worker.models.{module}"), name)
