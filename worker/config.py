"""Engine settings, validated once at start-up, and the command-line flags that set them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # HF checkpoint folder; None = the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    gpu_memory_fraction: float = 0.9  # share of the whole card this engine may use (weights + KV + activations)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; the default on CPU is 1 GiB
    num_gpu_blocks_override: int | None = None  # force the number of KV blocks (tests, benchmarks)
    quantization: str | None = None  # None or "fp8" (Hopper)
    seed: int = 0
    async_scheduling: bool = True  # overlap decode steps: launch step N+1 before reading step N's tokens
    enable_lora: bool = False  # keep slots for LoRA adapters, loaded and unloaded while serving
    max_loras: int = 4  # adapters loaded at once
    max_lora_rank: int = 16
    compile_workers: int | None = None  # processes compiling GPU kernels at a cold start (worker/precompile.py); None: auto, 0: none
    cpu_threads: int | None = None  # torch threads on CPU; default half the cores (the server and tokenizer need the rest)

    def validate(self) -> "EngineConfig":
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in ("auto", "float32", "float16", "bfloat16"), f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        need(self.max_model_len is None or self.max_model_len > 0, f"max_model_len must be > 0, got {self.max_model_len}")
        need(self.max_num_seqs > 0, f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens > 0, f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        need(self.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        need(0.0 < self.gpu_memory_fraction <= 1.0, f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")
        need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0, "num_gpu_blocks_override must be > 0")
        need(self.quantization in (None, "fp8"), f"quantization must be fp8 or unset, got {self.quantization!r}")
        need(self.max_loras > 0 and self.max_lora_rank > 0, "max_loras and max_lora_rank must be > 0")
        need(self.compile_workers is None or self.compile_workers >= 0, f"compile_workers must be >= 0, got {self.compile_workers}")
        need(not (self.enable_lora and self.quantization), "LoRA adapters run on bf16 / fp32 weights; drop --quantization to use them")
        return self


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by serve, generate and bench, named like vLLM's."""
    d = EngineConfig()
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", dest="gpu_memory_fraction", type=float, default=d.gpu_memory_fraction, help="share of the GPU this engine may use (0.35 beside a trainer)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="explicit KV budget (CPU default 1 GiB)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--enable-lora", action="store_true", help="keep slots for LoRA adapters (PEFT folders)")
    parser.add_argument("--max-loras", type=int, default=d.max_loras, help="LoRA adapters loaded at once")
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="overlap decode steps with the host's bookkeeping")
    parser.add_argument("--compile-workers", type=int, default=d.compile_workers,
                        help="processes that compile GPU kernels in parallel at a cold start (default: half the CPUs this "
                             "process may use, its container's CPU limit included, at most 6; 0: compile in this one)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, gpu_memory_fraction=args.gpu_memory_fraction, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, quantization=args.quantization, seed=args.seed, cpu_threads=args.cpu_threads, async_scheduling=args.async_scheduling,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        compile_workers=args.compile_workers,
    ).validate()
