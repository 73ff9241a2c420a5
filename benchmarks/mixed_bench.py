"""The offline mixed workloads (ANCHORS.md: 256 requests seed 0, 2048 requests seed 1; input 64-1024, output
32-512 tokens) under several caps on running sequences, in bf16 and FP8: one engine per (dtype, cap).

vLLM's anchor figures came from its offline defaults on this GPU class, max_num_seqs 1024 and 16,384 batched
tokens, which gpu_bench.py uses since run V; before, it capped the engine at 512. On the 2048-request draw the
cap decides how many sequences share each step's weight reads and how many prompts wait; the 256-request
draw never reaches 512.

Usage: python3 benchmarks/mixed_bench.py [OUT_DIR] [--dtypes bf16,fp8] [--max-num-seqs 512,1024]
       [--workloads 256,2048]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from gpu_bench import ROOT, engine  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402

from pagefleet.worker.entrypoints.cli.bench_throughput import draw_requests, run_engine  # noqa: E402

SEEDS = {256: 0, 2048: 1}  # the anchors' draws


def run_cap(model: str, fp8: bool, max_num_seqs: int, workloads: list[int], vocab: int = 128256) -> dict:
    """{workload: run_engine's figures} for one engine, with gpu_bench.py's other settings."""
    eng = engine(model, quantization="fp8" if fp8 else None, max_num_seqs=max_num_seqs)
    rows = {"kv_blocks": eng.block_manager.num_blocks}
    for n in workloads:
        rows[n] = run_engine(eng, draw_requests(n, SEEDS[n], (64, 1024), (32, 512), vocab), warmup=n == workloads[0])
        print(f"{'fp8' if fp8 else 'bf16'} max_num_seqs {max_num_seqs} mixed {n}: {rows[n]['output_tok_per_s']:,.1f} "
              f"output tok/s in {rows[n]['seconds']:.1f}s, {rows[n]['steps']} steps, "
              f"preemptions {rows[n]['preemptions']}, KV waste {100 * rows[n]['kv_waste']:.2f} %", flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=".")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--max-num-seqs", default="512,1024")
    ap.add_argument("--workloads", default="256,2048")
    args = ap.parse_args()
    dtypes, caps, workloads = args.dtypes.split(","), args.max_num_seqs.split(","), args.workloads.split(",")
    if not set(dtypes) <= {"bf16", "fp8"} or not all(c.isdigit() and int(c) > 0 for c in caps) \
            or not set(workloads) <= {str(n) for n in SEEDS}:
        ap.error(f"--dtypes takes bf16,fp8; --max-num-seqs positive integers; --workloads {','.join(map(str, SEEDS))}")
    model = make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b")
    workloads = [int(n) for n in workloads]
    results = {}
    for dtype in dtypes:
        for cap in map(int, caps):
            results[f"{dtype}_{cap}"] = run_cap(model, dtype == "fp8", cap, workloads)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mixed_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| dtype | max_num_seqs | " + " | ".join(f"mixed {n} tok/s (steps, preemptions)" for n in workloads) + " |")
    print("|---|---|" + "---|" * len(workloads))
    for key, rows in results.items():
        dtype, cap = key.split("_")
        cells = " | ".join(f"{rows[n]['output_tok_per_s']:,.1f} ({rows[n]['steps']}, {rows[n]['preemptions']})"
                           for n in workloads)
        print(f"| {dtype} | {cap} | {cells} |")


if __name__ == "__main__":
    main()
