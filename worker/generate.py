"""`pagefleet generate`: run prompts (or one chat message) through the engine from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.sampling import SamplingParams


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
    parser.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction, help="share of the GPU this engine may use (0.35 beside a trainer)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="explicit KV budget (CPU default 1 GiB)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--cpu-threads", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, gpu_memory_fraction=args.gpu_memory_fraction, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, quantization=args.quantization, seed=args.seed, cpu_threads=args.cpu_threads,
    ).validate()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("prompts", nargs="*", help="prompts (plain completion); see --chat")
    parser.add_argument("--chat", action="store_true", help="treat each prompt as one user message through the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--json", action="store_true", help="one JSON object per output")


def run(args: argparse.Namespace) -> int:
    from pagefleet.worker.llm import LLM

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, stop=args.stop
        ).validate()
        prompts = args.prompts or ["Write one sentence about the sea."]
        config = engine_config_from_args(args)
        llm = LLM(**{k: v for k, v in vars(config).items()})
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"pagefleet generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}))
            else:
                print(f"[{c.index}] {prompt!r} -> {c.text!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
    return 0
