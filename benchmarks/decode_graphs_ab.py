"""Decode steps of one engine with two or more sets of decode graphs, each captured under one setting.

Arms (each starts from the defaults):
  base     the engine's own settings
  rows32   bf16 linears of up to 32 rows through our GEMV (ops.SKINNY_MAX_ROWS 32, not 16), norms folded
  torch_embed  a folded step's embeddings and their sums of squares by torch (an embedding, then
           .float().square().sum()), as before kernels/norm.embed_rows
  no_pdl   the GEMV and the decode attention launched without programmatic dependent launch (kernels/pdl.py)
Run S's PDL arm released dependents after the main loop (f0ac536) and measured slower; run T's releases
them at exit (docs/benchmarks.md, runs S and T).

One engine and one checkpoint (Llama-3.1-8B shape); every arm's graphs are captured in the same process,
and the arms take turns (a, b, a, b, ...) so drift falls on all of them. Each cell: one decode step at batch
b and context ctx, the median over the turns, against its floor (weights + KV read / copy bandwidth).

  python3 benchmarks/decode_graphs_ab.py OUT_DIR [--arms base,rows32] [--fp8] [--turns 3]
                                                 [--batches 16,17,24,32,48] [--contexts 640,1024]

Writes OUT_DIR/decode_graphs_ab.json; prints a table with each arm's time and its ratio to the first arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import gpu_bench  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402

from pagefleet.kernels import pdl  # noqa: E402
from pagefleet.kernels import reference as ref  # noqa: E402
from pagefleet.worker.models.layers import ops# noqa: E402
from pagefleet.worker.executor.graphs.decode import DecodeGraphs  # noqa: E402


def torch_embed_rows(ids, table):
    """The folded path's embeddings as they were before kernels/norm.embed_rows (4 launches)."""
    rows = F.embedding(ids, table)
    return rows, ref.row_sum_squares(rows)


DEFAULTS = {"rows": ops.SKINNY_MAX_ROWS, "embed_rows": ops.embed_rows, "pdl": pdl.ENABLED}
ARMS = {"base": {}, "rows32": {"rows": 32}, "torch_embed": {"embed_rows": torch_embed_rows}, "no_pdl": {"pdl": False}}


def apply(setting: dict) -> None:
    s = {**DEFAULTS, **setting}
    ops.SKINNY_MAX_ROWS, ops.embed_rows, pdl.ENABLED = s["rows"], s["embed_rows"], s["pdl"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", nargs="?", default=".")
    p.add_argument("--arms", default="base,rows32", help="comma-separated: " + ", ".join(ARMS))
    p.add_argument("--fp8", action="store_true", help="the engine with --quantization fp8")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--batches", default="16,17,24,32,48")
    p.add_argument("--contexts", default="640,1024")
    return p.parse_args()


def capture(runner, arm: str) -> DecodeGraphs:
    """The engine's decode graph sizes, captured under the arm's setting (the defaults restored after)."""
    apply(ARMS[arm])
    try:
        old = runner.graphs
        graphs = DecodeGraphs(runner.model, runner.device, old.sizes, old.max_model_len, runner.max_blocks_per_seq)
        graphs.capture()
    finally:
        apply({})
    print(f"{arm}: captured {len(old.sizes)} decode graphs in {graphs.capture_seconds:.1f}s", flush=True)
    return graphs


def main():
    args = parse_args()
    arms = args.arms.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    gpu_bench.SECTIONS.append("ceilings")  # gpu_bench's sections come from its own argv, which is ours here
    gpu_bench.ceilings()
    path = make_checkpoint("llama-3.1-8b", f"{gpu_bench.ROOT}/llama-3.1-8b")
    # graphs up to 64 sequences, once per arm: a smaller KV budget than gpu_bench's leaves room for them
    eng = gpu_bench.engine(path, max_num_seqs=64, gpu_memory_fraction=0.8,
                           quantization="fp8" if args.fp8 else None)
    graph_sets = {arm: capture(eng.runner, arm) for arm in arms}
    times: dict = {}
    for turn in range(args.turns):
        for arm in arms:
            eng.runner.graphs = graph_sets[arm]
            for row in gpu_bench.decode_steps(eng, batches, contexts):
                if "step_ms" in row:
                    times.setdefault((row["batch"], row["context"], arm), []).append(row)
        print(f"turn {turn + 1}/{args.turns} done", flush=True)
    rows = []
    for ctx in contexts:
        for b in batches:
            cell = {"batch": b, "context": ctx}
            for arm in arms:
                got = times.get((b, ctx, arm), [])
                if got:
                    cell[f"ms_{arm}"] = statistics.median(r["step_ms"] for r in got)
                    cell["floor_ms"] = got[0]["floor_ms"]
            rows.append(cell)
    with open(os.path.join(args.out_dir, "decode_graphs_ab.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "arms": arms, "fp8": args.fp8, "turns": args.turns,
                   "rows": rows, "ceilings": gpu_bench.RESULTS.get("ceilings")}, f, indent=1)
    first = arms[0]
    print("\n| batch | context | " + " | ".join(f"{a} ms" for a in arms) + " | "
          + " | ".join(f"{first} / {a}" for a in arms[1:]) + " | floor ms |")
    print("|---" * (3 + 2 * len(arms) - 1) + "|")
    for r in rows:
        if all(f"ms_{a}" in r for a in arms):
            print(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{r[f'ms_{a}']:.3f}" for a in arms) + " | "
                  + " | ".join(f"{r[f'ms_{first}'] / r[f'ms_{a}']:.3f}" for a in arms[1:]) + f" | {r['floor_ms']:.3f} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f} s")
