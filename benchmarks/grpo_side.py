"""GRPO rollouts on one engine (vllm | pagefleet), with a KV cache dtype: the workload of the peer's
side_offline.py --grpo (64 prompts x n = 16, 256 tokens in, 512 out, temperature 1, a seed per prompt; max_model_len
2048, GPU share 0.85, 1024 sequences, 16,384 batched tokens), with --kv-cache-dtype passed to both engines. One
RESULT line, in side_offline.py's form, for benchmarks/side_by_side.sh's table.

Usage: python3 benchmarks/grpo_side.py ENGINE DTYPE CKPT [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["vllm", "pagefleet"])
    p.add_argument("dtype", choices=["bf16", "fp8"])
    p.add_argument("ckpt")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    a = p.parse_args()
    rng = random.Random(1234)
    quantization = "fp8" if a.dtype == "fp8" else None
    common = dict(max_model_len=2048, max_num_seqs=1024, max_num_batched_tokens=16384, kv_cache_dtype=a.kv_cache_dtype,
                  quantization=quantization)
    t0 = time.time()
    print(f"loading {a.engine} ({a.dtype} weights, KV cache {a.kv_cache_dtype})", flush=True)
    if a.engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=a.ckpt, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.85, seed=0,
                  **common)

        def generate(prompts, params):
            res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
            return sum(len(o.token_ids) for r in res for o in r.outputs)
    else:
        from pagefleet.worker import LLM, SamplingParams

        llm = LLM(a.ckpt, gpu_memory_fraction=0.85, **common)

        def generate(prompts, params):
            return sum(len(o.token_ids) for r in llm.generate(prompts, params) for o in r.outputs)

    def params(out_len, n=1, seed=None):
        return SamplingParams(n=n, max_tokens=out_len, min_tokens=out_len, ignore_eos=True, temperature=1.0,
                              detokenize=False, seed=seed)

    result = {"engine": a.engine, "dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype,
              "init_s": round(time.time() - t0, 1)}
    print("init", result, flush=True)
    prompts = [[rng.randint(100, 120000) for _ in range(256)] for _ in range(64)]
    generate(prompts[:2], [params(8, n=2)] * 2)  # warm the sampled path
    t = time.time()
    n = generate(prompts, [params(512, n=16, seed=i) for i in range(64)])
    dt = time.time() - t
    assert n == 64 * 16 * 512, n
    result["grpo_64x16"] = dict(s=round(dt, 2), out_tokens=n, out_tok_s=round(n / dt, 1))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
