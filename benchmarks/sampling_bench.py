"""Sampled against greedy decoding offline: the same 64 prompts (512 in / 128 out) under five sampling settings.

One engine on one GPU, prefix cache reset before each run, each setting run twice and the second run printed
(the first compiles nothing after start-up, but warms the allocator). What the device-side sampler costs per
setting, beside greedy: temperature alone, top-p, top-k with top-p, a per-request seed.
Usage: python3 benchmarks/sampling_bench.py MODEL_DIR (e.g. from make_checkpoint.py llama-3.1-8b DIR)
"""

from __future__ import annotations

import argparse
import random
import time

from pagefleet.worker import LLM, SamplingParams

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1": dict(temperature=1.0),
    "temperature 1, top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "temperature 0.8, top-p 0.95, top-k 50": dict(temperature=0.8, top_p=0.95, top_k=50),
    "temperature 1, seeded": dict(temperature=1.0, seed=7),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint folder")
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_fraction=0.85)
    random.seed(0)
    prompts = [[random.randrange(100, 120000) for _ in range(512)] for _ in range(args.prompts)]
    greedy = None
    for rep in range(2):
        for name, settings in SETTINGS.items():
            params = SamplingParams(max_tokens=128, ignore_eos=True, detokenize=False, **settings)
            llm.engine.block_manager.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if rep:
                rate = tokens / seconds
                greedy = greedy or rate
                print(f"{name:40s} {rate:9.1f} output tok/s ({seconds:.2f} s) {rate / greedy:.2f}x greedy", flush=True)


if __name__ == "__main__":
    main()
