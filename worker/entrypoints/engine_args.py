"""The engine's command-line flags, shared by serve, generate and bench, named like vLLM's."""

from __future__ import annotations

import argparse

from pagefleet.worker.core.config import KV_CACHE_DTYPES, MAMBA_SSM_DTYPES, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("--model", default=None,
                        help="HF checkpoint folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--mixed-prefill-tokens", type=int, default=d.mixed_prefill_tokens,
                        help="the most prompt tokens a step that also decodes runs (default: the whole token "
                             "budget); a few hundred let prompt chunks ride along decode steps")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", dest="gpu_memory_fraction", type=float,
                        default=d.gpu_memory_fraction,
                        help="share of the GPU this engine may use (0.35 beside a trainer)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="explicit KV budget (CPU default 1 GiB)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                        help="the paged KV cache's storage (auto: the model dtype; fp8: e4m3 at scale 1.0, half the "
                             "bytes, so twice the tokens in the same memory and half the attention reads)")
    parser.add_argument("--mamba-ssm-cache-dtype", default=d.mamba_ssm_cache_dtype, choices=list(MAMBA_SSM_DTYPES),
                        help="a hybrid model's recurrent state in the cache (auto: the checkpoint's mamba_ssm_dtype, "
                             "else the model dtype; bfloat16 halves it against float32)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--enable-lora", action="store_true", help="keep slots for LoRA adapters (PEFT folders)")
    parser.add_argument("--max-loras", type=int, default=d.max_loras, help="LoRA adapters loaded at once")
    parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank)
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        help="let sleep / wake_up hand the weights' and KV cache's GPU memory back to the driver "
                             "(a trainer on the same GPU) and take it back, CUDA graphs kept")
    parser.add_argument("--structured-outputs-jump-forward", action="store_true",
                        help="structured outputs: append the text a grammar forces (keys, quotes, colons) at once and "
                             "run it through the model as one chunk instead of a step a token; those tokens are "
                             "xgrammar's longest-match split of the text, which may differ from the tokenizer's")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="overlap decode steps with the host's bookkeeping")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="GPUs of this host one model is split over, a process each (1, 2, 4 or 8; on CPU, "
                             "gloo ranks)")
    parser.add_argument("--compile-workers", type=int, default=d.compile_workers,
                        help="processes that compile GPU kernels in parallel at a cold start (default: half the CPUs "
                             "this process may use, its container's CPU limit included, at most 6; 0: compile in this "
                             "one)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        mixed_prefill_tokens=args.mixed_prefill_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
        gpu_memory_fraction=args.gpu_memory_fraction, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, quantization=args.quantization, seed=args.seed,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, kv_cache_dtype=args.kv_cache_dtype,
        cpu_threads=args.cpu_threads, async_scheduling=args.async_scheduling,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        compile_workers=args.compile_workers, enable_sleep_mode=args.enable_sleep_mode,
        tensor_parallel_size=args.tensor_parallel_size,
        structured_outputs_jump_forward=args.structured_outputs_jump_forward,
    ).validate()
