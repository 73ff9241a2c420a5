"""FP8 linears at 33..128 rows: our fp8 tensor-core GEMM against torch._scaled_mm, as weight-read bandwidth.

  python3 benchmarks/fp8_skinny_bench.py OUT_DIR           # on the GPU: checks, times, sweeps (~3 min)
  TRITON_INTERPRET=1 python3 benchmarks/fp8_skinny_bench.py OUT_DIR --dry-run   # CPU: tiny shapes

For Llama-3.1-8B's four decoder linears (e4m3 weights, per-channel scales) and each M, with the rows already
quantised per token as a decode graph hands them over (ops.Fp8Rows): torch._scaled_mm as ops.linear runs it
past 32 rows today, the same with the operands swapped (W @ xq^T, then the transpose copied: the weight rows
on cuBLASLt's M side), kernels/fp8_skinny.py at its default config, and the best of a sweep at 64 rows, also
timed at the other Ms. Each op is checked against the fp32 product first, then timed inside a CUDA graph over 32
distinct weights (gemv_bench.time_per_op: the L2 cannot hold them). Prints the table and the 32 layers' totals
per M; writes OUT_DIR/fp8_skinny.json.
"""
import argparse
import itertools
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import copy_bandwidth, nearest_configs, rel_err, time_per_op  # noqa: E402

import pagefleet.kernels.arrivals as arrivals  # noqa: E402
import pagefleet.kernels.fp8 as F8  # noqa: E402
import pagefleet.kernels.fp8_skinny as S  # noqa: E402
import pagefleet.kernels.reference as R  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (160, 64), "down": (64, 256)}
LAYERS = 32
SWEEP = {"block_n": (64, 128), "block_k": (128, 256), "num_warps": (4, 8), "num_stages": (3, 4, 5),
         "split_k": (1, 2, 4, 8)}


def sweep_configs(M, N, K, default, num_sms, limit):
    """Up to `limit` configs nearest the default (fewest knobs changed first); pruned: shared memory past 220 KB
    a block, grids under half an SM's worth of programs or over 4 an SM, slices under 2 K tiles."""
    keep = []
    for c in itertools.product(*SWEEP.values()):
        block_n, block_k, _, stages, split = c
        programs = math.ceil(N / block_n) * split
        if stages * (block_n + S.block_m(M)) * block_k > 220 * 1024 or not num_sms // 2 <= programs <= 4 * num_sms:
            continue
        if K // split < 2 * block_k:
            continue
        keep.append(c)
    return nearest_configs(default, keep, limit)


def name(c):
    return "n{} k{} w{} s{} sk{}".format(*c)


def bench_shape(shape, N, K, Ms, a, device, num_sms, failures, t0):
    """Rows (one per M) for one weight shape: check, sweep at a.sweep_m, then time each M."""
    rows = []
    weights = [R.quantize_weight_fp8((torch.randn(N, K, device=device) / math.sqrt(K)).to(torch.bfloat16))
               for _ in range(a.weights)]
    scales = {id(w): s for w, s in weights}
    qs = [w for w, _ in weights]
    xs = {M: R.quantize_fp8_per_token(torch.randn(M, K, device=device).to(torch.bfloat16)) for M in Ms}

    def ours(w, M, c=None):
        kw = dict(zip(SWEEP, c, strict=True)) if c else {}
        return S.fp8_skinny_gemm(*xs[M], w, scales[id(w)], **kw)

    def scaled(w, M):
        return F8.fp8_gemm(*xs[M], w, scales[id(w)])

    def swapped(w, M):
        xq, xsc = xs[M]
        return torch._scaled_mm(w, xq.t(), scale_a=scales[id(w)].view(-1, 1), scale_b=xsc.view(1, -1),
                                out_dtype=torch.bfloat16).t().contiguous()

    def check(label, fn, M):
        ref = R.fp8_gemm(*xs[M], qs[0], scales[id(qs[0])], None, torch.float32)
        err = rel_err(fn(qs[0], M).float(), ref)
        if not err < 2e-2:  # bf16 output of an fp32 sum
            failures.append(f"{shape} M={M} {label}: relative error {err:.3g}")
        return err

    default = S.default_config(a.sweep_m, N, K, num_sms)
    sweep = {}
    for c in sweep_configs(a.sweep_m, N, K, default, num_sms, a.max_configs):
        try:
            if check(name(c), lambda w, M, c=c: ours(w, M, c), a.sweep_m) < 2e-2:
                sweep[c] = time_per_op(lambda w, c=c: ours(w, a.sweep_m, c), qs, a.reps)
        except Exception as e:  # a config that does not compile (shared memory) drops out of the sweep
            failures.append(f"{shape} {name(c)}: {type(e).__name__}: {str(e)[:120]}")
    best = min(sweep, key=sweep.get) if sweep else default
    print(f"{shape}: sweep at M={a.sweep_m}, {len(sweep)} configs, best {name(best)} {sweep.get(best, 0):.1f} us, "
          f"default {name(default)} {sweep.get(default, float('nan')):.1f} us ({time.time() - t0:.0f} s)",
          flush=True)
    for M in Ms:
        d = S.default_config(M, N, K, num_sms)
        for label, fn in (("scaled_mm", scaled), ("swapped", swapped), ("default", lambda w, M, d=d: ours(w, M, d)),
                          ("best", lambda w, M: ours(w, M, best))):
            check(label, fn, M)
        r = {"shape": shape, "M": M, "N": N, "K": K, "best_config": name(best), "default_config": name(d),
             "scaled_mm": time_per_op(lambda w, M=M: scaled(w, M), qs, a.reps),
             "swapped": time_per_op(lambda w, M=M: swapped(w, M), qs, a.reps),
             "default": time_per_op(lambda w, M=M, d=d: ours(w, M, d), qs, a.reps),
             "best": time_per_op(lambda w, M=M: ours(w, M, best), qs, a.reps)}
        r["best_tbps"] = N * K / r["best"] / 1e6
        rows.append(r)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."))
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--ms", default="48,64,96,128")
    p.add_argument("--sweep-m", type=int, default=64, help="the batch the sweep runs at")
    p.add_argument("--max-configs", type=int, default=24)
    p.add_argument("--weights", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = "cuda" if cuda else "cpu"
    shapes, Ms = (SHAPES if cuda else DRY_SHAPES), [int(m) for m in a.ms.split(",")]
    if not cuda:
        a.weights, a.reps, a.max_configs = 2, 1, 3
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    arrivals.reserve(device)
    copy_tbps = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}: device copy {copy_tbps:.2f} TB/s", flush=True)
    torch.manual_seed(0)
    rows, failures, t0 = [], [], time.time()
    for shape, (N, K) in shapes.items():
        rows += bench_shape(shape, N, K, Ms, a, device, num_sms, failures, t0)
    print("\n| shape | M | scaled_mm us | swapped us | ours default us | ours best us (TB/s) | best config |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['M']} | {r['scaled_mm']:.1f} | {r['swapped']:.1f} | {r['default']:.1f} | "
              f"{r['best']:.1f} ({r['best_tbps']:.2f}) | {r['best_config']} |")
    print(f"\n32 layers' linears a decode step (us), device copy {copy_tbps:.2f} TB/s:")
    print("| M | scaled_mm | swapped | ours default | ours best |\n|---|---|---|---|---|")
    for M in Ms:
        tot = {k: LAYERS * sum(r[k] for r in rows if r["M"] == M) for k in ("scaled_mm", "swapped", "default", "best")}
        print(f"| {M} | {tot['scaled_mm']:,.0f} | {tot['swapped']:,.0f} | {tot['default']:,.0f} | {tot['best']:,.0f} |")
    print("failures:", failures or "none")
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "fp8_skinny.json"), "w") as f:
        json.dump({"rows": rows, "failures": failures, "copy_tbps": copy_tbps}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
