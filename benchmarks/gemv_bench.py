"""Skinny matmul (decode linears, M = 1..16) against cuBLAS on the GPU, as weight-read bandwidth.

  python3 benchmarks/gemv_bench.py OUT_DIR            # on the H200: checks, times, sweeps (~2 min)
  TRITON_INTERPRET=1 python3 benchmarks/gemv_bench.py OUT_DIR --dry-run   # CPU: tiny shapes, exercises the code
  python3 benchmarks/gemv_bench.py OUT_DIR --fp8      # weight-only FP8 (e4m3 + per-row scales) against
                                                      # cuBLAS bf16 and torch._scaled_mm (activations quantised)

For Llama-3.1-8B's five linear shapes and each M: torch.nn.functional.linear (cuBLAS), skinny_matmul's
default config, and the best of a sweep around that default. Every op is first checked against an fp32
reference on fresh random inputs, then timed inside a CUDA graph that runs it 32 times back to back on 32
different weights of the shape (so the 50 MB L2 cannot hold the weight): time per op = graph time / 32,
median of 20 replays. Bandwidth = weight bytes / time, beside a measured device copy (read + write).
Writes OUT_DIR/gemv.json (rows, every config timed, the decode-step totals) and OUT_DIR/gemv.md (the table).
Apart from kernels_bench.py, and over 300 lines, because it times inside CUDA graphs over many weights and
sweeps each shape's tiles, which no other kernel needs.
"""
import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch
import torch.nn.functional as F

import pagefleet.kernels.arrivals as arrivals
import pagefleet.kernels.fp8 as F8
import pagefleet.kernels.gemv as G
import pagefleet.kernels.reference as R

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # Llama-3.1-8B: name -> (N, K)
DRY_SHAPES = {"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (160, 64), "down": (64, 200), "lm_head": (300, 64)}
LAYERS = 32
SWEEP = {"block_n": (16, 32, 64), "block_k": (128, 256, 512, 1024), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5),
         "split_k": (1, 2, 4)}  # no block_n 8: the kernel's tl.dot needs 16 rows
KEYS = list(SWEEP)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."), help="gets gemv.json and gemv.md")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--ms", default="1,2,4,8,16", help="batch sizes M")
    p.add_argument("--max-configs", type=int, default=40, help="sweep size per (shape, M), default included")
    p.add_argument("--weights", type=int, default=32, help="distinct weights per graph (ops per graph)")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    p.add_argument("--fp8", action="store_true", help="e4m3 weights with per-row scales (worker/models/layers/fp8.py)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    return p.parse_args()


# ---------------------------------------------------------------- measuring


def rel_err(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def median_us(fn, reps, cuda):
    """Median microseconds of fn() over reps runs: CUDA events on the GPU, a host clock on the CPU."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def time_per_op(op, weights, reps):
    """Microseconds per op(w): all weights back to back in one CUDA graph, median of reps replays / len(weights).

    On the CPU (dry run) the same loop runs without a graph.
    """
    if not weights[0].is_cuda:
        return median_us(lambda: [op(w) for w in weights], reps, False) / len(weights)
    side = torch.cuda.Stream()  # warm up on a side stream, as graph capture wants (compiles, cuBLAS handles)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(weights[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            op(w)
    for _ in range(3):
        graph.replay()
    us = median_us(graph.replay, reps, True) / len(weights)
    del graph
    return us


def copy_bandwidth(device):
    """TB/s of a device-to-device copy of a 1 GiB tensor, bytes read + written (the practical ceiling).

    Plain launches, not a graph: captured, torch's copy_ became a copy-engine memcpy node that moved
    2.7 TB/s on the H200, against 4.2 as the kernel it launches outside a graph.
    """
    n = (1 << 16) if device == "cpu" else (1 << 29)  # bf16 elements: 1 GiB
    a = torch.randn(n, device=device).to(torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(20):  # the clocks ramp up from idle
        b.copy_(a)
    us = median_us(lambda: b.copy_(a), 20, device == "cuda")
    return 2 * a.numel() * a.element_size() / us / 1e6


# ---------------------------------------------------------------- configs


def sweep_configs(M, N, K, default, num_sms, limit, weight_bytes=2):
    """Up to `limit` configs nearest the default (fewest knobs changed, then the smallest changes).

    Pruned: shared memory past the H200's 227 KB a block (num_stages x the weight and x tiles), grids
    that leave SMs idle, split-K where the N tiles alone give 2 programs an SM, empty splits.
    """
    keep = []
    for c in itertools.product(*SWEEP.values()):
        block_n, block_k, _, num_stages, split_k = c
        n_tiles = math.ceil(N / block_n)
        if num_stages * (block_n * weight_bytes + 32) * block_k > 227 * 1024:
            continue
        if n_tiles * split_k < num_sms or (split_k > 1 and n_tiles >= 2 * num_sms):
            continue
        if split_k > 1 and math.ceil(K / split_k) < block_k:
            continue
        keep.append(c)
    return nearest_configs(default, keep, limit)


def nearest_configs(default, configs, limit):
    """The default, then up to limit - 1 of configs nearest it: fewest knobs changed, then the smallest changes
    (log2 steps). Configs are tuples of powers of two in one order."""
    def distance(c):
        changed = sum(a != b for a, b in zip(c, default, strict=True))
        return changed, sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(c, default, strict=True))

    return [tuple(default)] + sorted((c for c in configs if c != tuple(default)), key=distance)[: limit - 1]


def config_name(c):
    return "n{} k{} w{} s{} sk{}".format(*c)


# ---------------------------------------------------------------- one shape


def make_weights(N, K, count, dtype, device):
    return [(torch.randn(N, K, device=device) / math.sqrt(K)).to(dtype) for _ in range(count)]


def bench_shape(name, N, K, Ms, args, dtype, device, num_sms, failures):
    """Rows (one per M) for one weight shape: check, then time cuBLAS, our default, and the sweep.

    --fp8: ours reads e4m3 weights (bandwidth over their bytes), checked against the product over the
    dequantised weight; cuBLAS stays bf16 over the same values, and torch._scaled_mm is timed beside it."""
    weights = make_weights(N, K, args.weights, dtype, device)
    scales = None
    if args.fp8:
        pairs = [R.quantize_weight_fp8(w) for w in weights]
        weights = [(q.float() * s[:, None]).to(dtype) for q, s in pairs]  # cuBLAS reads the same values in bf16
        quantized, scales = [q for q, _ in pairs], {id(q): s for q, s in pairs}
    ours_weights = quantized if args.fp8 else weights
    weight_bytes = N * K * ours_weights[0].element_size()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    rows = []
    for M in Ms:
        x = torch.randn(M, K, device=device).to(dtype)
        expected = R.skinny_matmul(x.float(), weights[0].float())

        def ours(w, x=x, **kw):
            return G.skinny_matmul(x, w, weight_scale=scales[id(w)] if scales else None, **kw)

        def tbps(us):
            return weight_bytes / us / 1e6

        cublas_err = rel_err(F.linear(x, weights[0]), expected)
        cublas_us = time_per_op(partial(F.linear, x), weights, args.reps)
        scaled_mm_us = None
        if args.fp8:
            scaled_mm_us = time_per_op(lambda w, x=x: F8.fp8_linear(x, w, scales[id(w)]), quantized, args.reps)
        default = G.default_config(M, N, K, num_sms, ours_weights[0].element_size())
        timed = []
        for c in sweep_configs(M, N, K, default, num_sms, args.max_configs, ours_weights[0].element_size()):
            kw = dict(zip(KEYS, c, strict=True))
            try:
                out = torch.full((M, N), float("nan"), device=device, dtype=dtype)
                err = rel_err(ours(ours_weights[0], out=out, **kw), expected)
                if err > tol:
                    failures.append(f"{name} M={M} {config_name(c)}: rel err {err:.2e}")
                    print(f"  FAIL {name} M={M} {config_name(c)}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
                    continue
                us = time_per_op(partial(ours, **kw), ours_weights, args.reps)
            except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
                print(f"  skip {config_name(c)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
                continue
            timed.append({"config": dict(kw), "us": us, "TBps": tbps(us), "rel_err": err})
        ours = timed[0] if timed and timed[0]["config"] == dict(zip(KEYS, default, strict=True)) else None
        if ours is None:
            failures.append(f"{name} M={M}: the default config failed")
        best = min(timed, key=lambda t: t["us"]) if timed else None
        row = {"shape": name, "N": N, "K": K, "M": M, "weight_MB": weight_bytes / 1e6,
               "cublas_us": cublas_us, "cublas_TBps": N * K * weights[0].element_size() / cublas_us / 1e6,
               "cublas_rel_err": cublas_err,
               "scaled_mm_us": scaled_mm_us,
               "default_config": dict(zip(KEYS, default, strict=True)),
               "default_us": ours and ours["us"], "default_TBps": ours and ours["TBps"],
               "default_rel_err": ours and ours["rel_err"],
               "best_config": best and best["config"], "best_us": best and best["us"],
               "best_TBps": best and best["TBps"], "sweep": sorted(timed, key=lambda t: t["us"])}
        rows.append(row)
        top = ", ".join(f"{config_name(tuple(t['config'].values()))} {t['us']:.1f}" for t in row["sweep"][:3])
        print(f"{name:8s} M={M:2d}  cuBLAS {cublas_us:8.1f} us {row['cublas_TBps']:5.2f} TB/s | _scaled_mm "
              f"{fmt(scaled_mm_us)} us | default "
              f"{fmt(row['default_us'])} us {fmt(row['default_TBps'], 2)} TB/s | best {fmt(row['best_us'])} us "
              f"{fmt(row['best_TBps'], 2)} TB/s ({len(timed)} timed; top: {top})", flush=True)
    del weights, ours_weights
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


# ---------------------------------------------------------------- summary


def decode_step(rows):
    """M = 1: one Llama-3.1-8B decode step's linears, 32 x (qkv, o, gate_up, down) + lm_head, in us."""
    by_shape = {r["shape"]: r for r in rows if r["M"] == 1}
    if set(by_shape) != set(SHAPES):
        return None
    count = {name: LAYERS for name in SHAPES}
    count["lm_head"] = 1
    totals = {}
    for key in ("cublas_us", "default_us", "best_us"):
        if any(by_shape[n][key] is None for n in SHAPES):
            totals[key] = None
        else:
            totals[key] = sum(count[n] * by_shape[n][key] for n in SHAPES)
    return totals


def markdown(rows, copy_tbps, step):
    lines = [f"Device copy bandwidth (read + write): {copy_tbps:.2f} TB/s. Time per op; TB/s = weight bytes / time.",
             "",
             "| shape (N x K) | M | cuBLAS us | cuBLAS TB/s | ours default us | TB/s | best us | TB/s | best config |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        best = config_name(tuple(r["best_config"].values())) if r["best_config"] else "-"
        lines.append(f"| {r['shape']} ({r['N']} x {r['K']}) | {r['M']} | {r['cublas_us']:.1f} | "
                     f"{r['cublas_TBps']:.2f} | {fmt(r['default_us'])} | {fmt(r['default_TBps'], 2)} | "
                     f"{fmt(r['best_us'])} | {fmt(r['best_TBps'], 2)} | {best} |")
    if step:
        lines += ["", f"M = 1 decode step, {LAYERS} x (qkv, o_proj, gate_up, down) + lm_head: cuBLAS "
                  f"{fmt(step['cublas_us'])} us, ours default {fmt(step['default_us'])} us, "
                  f"ours best {fmt(step['best_us'])} us"]
    return "\n".join(lines) + "\n"


def write_results(out_dir, rows, copy_tbps, num_sms, failures, seconds, device_name):
    """gemv.md and gemv.json; rewritten after every shape, so a run cut short keeps what it measured."""
    step = decode_step(rows)
    table = markdown(rows, copy_tbps, step)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gemv.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "gemv.json"), "w") as f:
        json.dump({"device": device_name, "copy_TBps": copy_tbps, "num_sms": num_sms, "rows": rows,
                   "decode_step_M1_us": step, "failures": failures, "seconds": seconds}, f, indent=1)
    return table


def main():
    args = parse_args()
    device = "cpu" if args.dry_run else "cuda"
    arrivals.reserve(device)  # split-K configs merge through them, in graphs too
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter mishandles bf16 arithmetic
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    if args.dry_run:
        args.weights, args.reps, args.max_configs = 2, 1, min(args.max_configs, 3)
    Ms = [int(m) for m in args.ms.split(",")]
    # The dry run's tiny N would leave 132 SMs idle and prune every sweep config.
    num_sms = 4 if args.dry_run else torch.cuda.get_device_properties(0).multi_processor_count
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    torch.manual_seed(0)
    t0 = time.time()
    copy_tbps = copy_bandwidth(device)
    print(f"device copy: {copy_tbps:.2f} TB/s (read + write); {num_sms} SMs", flush=True)
    rows, failures = [], []
    for name, (n, k) in shapes.items():
        try:
            rows += bench_shape(name, n, k, Ms, args, dtype, device, num_sms, failures)
        except Exception:  # report and go on: device time is scarce
            traceback.print_exc()
            failures.append(name)
        table = write_results(args.out_dir, rows, copy_tbps, num_sms, failures, time.time() - t0, device_name)
    print("\n" + table, flush=True)
    print(f"{time.time() - t0:.0f} s; failures: {failures or 'none'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
