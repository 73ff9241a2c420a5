"""What a prompt token costs riding in a decode step: GPU and wall time of steps that mix D decodes with a
P-token prompt chunk, against the pure decode step of D.

Under the serving load (benchmarks/closed_loop_bench.py) the prompts come in waves: a few steps carry
thousands of prompt tokens each, and the ~120 decode-only steps between waves are bound by reading the
weights, with the tensor cores mostly idle. If a decode step can take on P prompt tokens for little more
GPU time, spreading each wave's prompts over the decode steps would raise throughput. This measures the
price per P: for each decode batch D (every sequence at context 640, as gpu_bench's roofline sets them
up), steps of D decodes plus one fresh P-token prompt (max_tokens=1, so it leaves after its step), with
the step's token budget at D + P. Per step: the GPU's busy time (the union of kernel intervals under the
torch profiler) and the wall time (steps run back to back, as the engine runs them).

Steps of at most 64 decodes beside at most 1,024 prompt tokens replay a mixed graph (worker/executor/graphs/mixed.py);
--eager-too runs each such step eagerly as well, in turn, on the same engine.

Usage: python3 benchmarks/mixed_step_bench.py [--model PATH] [--fp8] [--decodes 16,32,64]
       [--prompts 0,64,128,256,512,1024,2048] [--steps 12] [--eager-too]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from pagefleet.worker import SamplingParams# noqa: E402
from pagefleet.worker.core.config import EngineConfig  # noqa: E402
from pagefleet.worker.engine.llm_engine import LLMEngine  # noqa: E402

from closed_loop_bench import gpu_busy_share  # noqa: E402
from gpu_bench import abort_all, fake_prefilled  # noqa: E402


def measure(eng: LLMEngine, decodes: int, prompt: int, steps: int, rng: random.Random, context: int = 640) -> dict:
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    eng.scheduler.max_num_batched_tokens = max(1, decodes + prompt)
    fake_prefilled(eng, decodes, context)
    n = 0

    def step() -> None:
        nonlocal n
        if prompt:
            eng.add_request(f"p{decodes}-{prompt}-{n}", [rng.randrange(100, vocab) for _ in range(prompt)], params)
            n += 1
        eng.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        profiled_s = time.perf_counter() - start
    gpu_ms = gpu_busy_share(prof, profiled_s) * profiled_s / steps * 1e3
    kinds = [(s.num_decode_tokens, s.num_prefill_tokens) for s in list(eng.recent_steps)[-steps:]]
    abort_all(eng)
    return {"decodes": decodes, "prompt": prompt, "gpu_ms": gpu_ms, "wall_ms": wall_ms, "steps_seen": kinds[-3:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the 8B-shaped random checkpoint)")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--decodes", default="16,32,64")
    ap.add_argument("--prompts", default="0,64,128,256,512,1024,2048")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eager-too", action="store_true", help="each mixed step again with the mixed graphs off, in turn")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from gpu_bench import ROOT
        from make_checkpoint import make_checkpoint

        model = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    prompts = [int(x) for x in args.prompts.split(",")]
    eng = LLMEngine(EngineConfig(model=str(model), quantization="fp8" if args.fp8 else None, max_model_len=4096,
                                 max_num_seqs=256, max_num_batched_tokens=max(8192, max(prompts) + 256)))
    rng = random.Random(0)
    rows = []
    graphs = eng.runner.mixed_graphs
    modes = ["graphs", "eager"] if args.eager_too and graphs is not None else ["graphs" if graphs is not None else "eager"]
    for d in (int(x) for x in args.decodes.split(",")):
        for p in prompts:
            for mode in modes if p else modes[:1]:
                eng.runner.mixed_graphs = graphs if mode == "graphs" else None
                row = measure(eng, d, p, args.steps, rng)
                row["mixed"] = mode if p else "-"
                rows.append(row)
                print(row, flush=True)
    eng.runner.mixed_graphs = graphs
    print("| decodes | prompt tokens | mixed step | GPU ms a step | wall ms a step | GPU µs a prompt token over the decode step |")
    print("|---|---|---|---|---|---|")
    base = {r["decodes"]: r["gpu_ms"] for r in rows if r["prompt"] == 0}
    for r in rows:
        extra = (r["gpu_ms"] - base[r["decodes"]]) * 1e3 / r["prompt"] if r["prompt"] and r["decodes"] in base else float("nan")
        print(f"| {r['decodes']} | {r['prompt']} | {r['mixed']} | {r['gpu_ms']:.2f} | {r['wall_ms']:.2f} | {extra:.1f} |")


if __name__ == "__main__":
    main()
