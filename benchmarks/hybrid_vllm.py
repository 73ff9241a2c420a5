"""vLLM on hybrid_bench.py's checkpoint and workloads, the same prompt stream, so the two print comparable rows.

Runs beside `hybrid_bench.py run DIR OUT --grpo-prompts P --only ROWS` on one GPU, in one run (`.peer/` set up
as its README says, `source .peer/side_env.sh` first): engine start, then the rows named, in this order: batch1
(512 / 128), mixed256 (seed 0) greedy, grpo (P prompts x n = 16, 256 / 512, temperature 1, seeded), mixed2048
(seed 1) greedy; without names the first three. vLLM's Triton GDN prefill path, as the bundle has no FlashInfer.

Usage: python3 benchmarks/hybrid_vllm.py DIR [P] [ROW ...]   (prints RESULT lines, the last one JSON)
"""

import json
import random
import sys
import time

ROWS = ("batch1", "mixed256", "grpo", "mixed2048")


def main(folder: str, grpo_prompts: int, rows: tuple[str, ...] = ROWS[:3]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.85,
              max_model_len=2048, seed=0, limit_mm_per_prompt={"image": 0, "video": 0}, max_num_seqs=1024,
              max_num_batched_tokens=16384, additional_config={"gdn_prefill_backend": "triton"})
    out = {"init_s": round(time.time() - start, 1)}
    print("RESULT", out, flush=True)
    rng = random.Random(1)  # hybrid_bench.run's stream: warm-up, batch 1, mixed 256, warm-up, GRPO, in order

    def go(reqs, temperature=0.0, n=1, seeded=False) -> float:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randint(100, 240000) for _ in range(p)]) for p, _ in reqs]
        params = [SamplingParams(n=n, max_tokens=o, min_tokens=o, ignore_eos=True, temperature=temperature,
                                 detokenize=False, seed=i if seeded else None) for i, (_, o) in enumerate(reqs)]
        t = time.time()
        results = llm.generate(prompts, params, use_tqdm=False)
        return round(sum(len(o.token_ids) for r in results for o in r.outputs) / (time.time() - t), 1)

    go([(64, 8)] * 4)
    if "batch1" in rows:
        out["batch1"] = go([(512, 128)])
        print("RESULT", out, flush=True)
    if "mixed256" in rows:
        random.seed(0)
        out["mixed256"] = go([(random.randint(64, 1024), random.randint(32, 512)) for _ in range(256)])
        print("RESULT", out, flush=True)
    if "grpo" in rows:
        go([(64, 8)] * 2, temperature=1.0, n=2, seeded=True)
        out["grpo"] = go([(256, 512)] * grpo_prompts, temperature=1.0, n=16, seeded=True)
        print("RESULT", out, flush=True)
    if "mixed2048" in rows:
        random.seed(1)
        out["mixed2048"] = go([(random.randint(64, 1024), random.randint(32, 512)) for _ in range(2048)])
    print("RESULT vllm_hybrid", json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM may spawn its engine process, which imports this file again
    bad = [r for r in sys.argv[3:] if r not in ROWS]
    if len(sys.argv) < 2 or bad:
        sys.exit(f"usage: hybrid_vllm.py DIR [P] [ROW ...]; rows: {' '.join(ROWS)}" + (f" (not {bad})" if bad else ""))
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64, tuple(sys.argv[3:]) or ROWS[:3])
