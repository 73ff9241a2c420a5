"""CUDA graphs against --enforce-eager, the way vLLM measured its 4.6x: two engines on one checkpoint, one with
every graph and one started with enforce_eager (no graphs, no folded norms), at batch 1 and 8 (512 prompt and
128 output tokens, ignore_eos, time includes prefill), in bf16 and FP8.

gpu_bench.py's eager section measures something narrower: the graphed engine with only its decode graphs
switched off (same process, same weights; prompt graphs and folded norms stay). That arm is printed here too,
so the two ratios sit side by side.

Usage: python3 benchmarks/eager_bench.py [OUT_DIR] [--dtypes bf16,fp8] [--model PATH]
Without --model: the random Llama-3.1-8B-shaped checkpoint (benchmarks/make_checkpoint.py). Its test runs
measure() on CPU with a tiny model, where every arm is eager.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from pagefleet.worker.entrypoints.cli.bench_throughput import run_static  # noqa: E402
from pagefleet.worker.core.config import EngineConfig  # noqa: E402
from pagefleet.worker.engine.llm_engine import LLMEngine  # noqa: E402

BATCHES = (1, 8)
PROMPT, OUTPUT = 512, 128


def throughput(eng: LLMEngine, batch: int) -> float:
    """Output tok/s of `batch` requests of PROMPT in / OUTPUT out, after an untimed run of the same shapes."""
    return run_static(eng, batch, PROMPT, OUTPUT)["output_tok_per_s"]


def measure(settings: dict) -> dict:
    """{batch: {graphs, decode_graphs_off, enforce_eager}} tok/s for EngineConfig(**settings); one engine at
    a time on the GPU."""
    rows = {b: {} for b in BATCHES}
    eng = LLMEngine(EngineConfig(**settings))
    for b in BATCHES:
        rows[b]["graphs"] = throughput(eng, b)
        decode_graphs, eng.runner.graphs = eng.runner.graphs, None
        rows[b]["decode_graphs_off"] = throughput(eng, b)
        eng.runner.graphs = decode_graphs
    del eng, decode_graphs  # the graphs hold the model and its KV cache: all of it goes before the next engine
    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine(EngineConfig(**settings, enforce_eager=True))
    for b in BATCHES:
        rows[b]["enforce_eager"] = throughput(eng, b)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=".")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--model", help="checkpoint folder (default: the 8B-shaped random checkpoint)")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"bf16", "fp8"}:
        ap.error(f"--dtypes takes bf16, fp8 or both, got {args.dtypes}")
    from gpu_bench import ROOT, engine_settings

    model = args.model
    if model is None:
        from make_checkpoint import make_checkpoint

        model = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    results = {}
    for dtype in dtypes:  # gpu_bench.py's settings but its sequence cap, which batches 1 and 8 never reach
        results[dtype] = measure(engine_settings(str(model), quantization="fp8" if dtype == "fp8" else None, max_num_seqs=512))
        print(dtype, results[dtype], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "eager_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| dtype | batch | graphs tok/s | --enforce-eager tok/s | ratio | decode graphs off tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for dtype, rows in results.items():
        for b, r in rows.items():
            print(f"| {dtype} | {b} | {r['graphs']:,.1f} | {r['enforce_eager']:,.1f} | {r['graphs'] / r['enforce_eager']:.2f}× | "
                  f"{r['decode_graphs_off']:,.1f} | {r['graphs'] / r['decode_graphs_off']:.2f}× |")


if __name__ == "__main__":
    main()
