"""Random-weight HF checkpoints from real configs (Llama-3.1-8B, Qwen3-8B shapes) for GPU benchmarks.

Weights are drawn on the GPU in bf16 and written as sharded safetensors with an index, plus a
word-level tokenizer ("t0" ... "tN"), so the engine loads them through its normal loader.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "hidden_act": "silu",
    },
}


def roomy(path: str, need: float) -> bool:
    """True when the filesystem of `path` has more than `need` bytes free (False when it is not there)."""
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize > need
    except OSError:
        return False


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if c["model_type"] == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def make_checkpoint(name: str, folder: str, num_layers: int | None = None, std: float = 0.02,
                    shard_bytes: int = 4 << 30) -> str:
    from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer

    config = dict(CONFIGS[name])
    if num_layers:
        config["num_hidden_layers"] = num_layers
    done = os.path.join(folder, "config.json")
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):  # written last: the weights are all there
        with open(done) as f:
            if json.load(f) == config:
                return folder
    os.makedirs(folder, exist_ok=True)
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shards, current, size, index = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            fname = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, os.path.join(folder, fname), metadata={"format": "pt"})
            shards.append(fname)
            index.update({k: fname for k in current})
            current, size = {}, 0

    for tname, shape in tensor_shapes(config).items():
        if len(shape) == 1:  # norm weights near 1, not exactly 1: the engine folds them into the next linears
            t = 1 + 0.2 * torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32)
            t = t.to(torch.bfloat16).cpu()
        else:
            t = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32) * std).to(torch.bfloat16).cpu()
        current[tname] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        total = sum(os.path.getsize(os.path.join(folder, s)) for s in shards)
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    with open(done, "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}, f)
    write_word_tokenizer(folder)  # reads config.json
    print(f"made {name} ({config['num_hidden_layers']} layers) in {folder} in {time.time() - start:.1f}s", flush=True)
    return folder


if __name__ == "__main__":
    make_checkpoint(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
