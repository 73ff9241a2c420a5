"""Checkpoints for the engine tests: the bundled SmolLM2, tiny random-weight Llama / Qwen2 / Qwen3 folders, and
PEFT LoRA adapters for them (make_adapter).

The tiny ones are written with transformers' own classes and save_pretrained, so our loader reads them
exactly as it reads a user's checkpoint; they reuse the bundled tokenizer (a word-level one where the
bundled model is not installed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer
from pagefleet.worker.models.loader import ModelFolderError, bundled_model_path

TINY_ARCHS = ("llama", "qwen2", "qwen3")


def tiny_model(arch: str, folder: Path) -> Path:
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    if (folder / "config.json").exists():
        return folder
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
        initializer_range=0.5,  # peaked logits, so greedy choices are not near-ties
    )
    if arch == "llama":
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 128}
        config = LlamaConfig(**common, rope_scaling=rope_scaling, rope_theta=500000.0)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config, cls = Qwen3Config(**common, head_dim=32), Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # transformers initialises norm weights to 1: make them count (the GPU engine folds them)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    if arch == "qwen2":  # Qwen2 has q/k/v biases: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    try:
        AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    except ModelFolderError:  # a machine without the bundled model (the GPU box): token ids are all these tests use
        write_word_tokenizer(str(folder))
    return folder


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(), one prompt at a time (no padding), greedy, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base, folder, seed, rank=4, targets=ALL_TARGETS):
    """A PEFT LoRA with random A and B (init_lora_weights=False: not a no-op), saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (folder / "adapter_config.json").exists():
        return folder
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random B is small; make the adapter move greedy choices
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(folder)
    return folder


def tiny_qwen3_5(folder: Path, layer_types=("linear_attention", "full_attention", "linear_attention",
                                            "full_attention"), seed: int = 0) -> Path:
    """A tiny random Qwen3.5 text checkpoint (Qwen3_5ForCausalLM): Gated DeltaNet and gated full-attention
    layers as layer_types says, vocabulary 512, every norm and gate weight made to count."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (folder / "config.json").exists():
        return folder
    config = Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=list(layer_types),
        max_position_embeddings=1024, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
        initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts the (1 + w) norms at 0, the gated norm at 1, dt_bias at 1
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0 if ".linear_attn.norm." in name else 0.0, 0.3)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    try:
        AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    except ModelFolderError:
        write_word_tokenizer(str(folder))
    return folder
