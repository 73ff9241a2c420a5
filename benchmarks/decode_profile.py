"""Where a decode step's time goes on the GPU: kernel time by kind, and the small-batch attention split sweep.

Sections:
  breakdown   Llama-3.1-8B shape, context 1k, batch 1 / 8 / 64 / 256 (or BREAKDOWN_BATCHES=16,32): one
              engine step under the torch profiler (CUDA graphs on, then eager), device time per step summed by kernel kind, against
              the step's wall time (the difference is launch gaps and host time the GPU waited for)
  mixed       the anchors' mixed workloads (256 requests seed 0, 2048 seed 1) on the same engine
  prefill     prompt steps of about 8k and 16k tokens (564-token prompts): kernel time by kind, µs per token
  trace       mixed 256 (seed 0) with every step recorded: time in prompt steps and in decode steps by batch
  fp8         (a flag, not a section) build the engine with --quantization fp8
  attention   paged decode attention alone at batch 1 / 4 / 8 / 16 / 32, context 640 / 1k / 4k, replayed in a
              CUDA graph 32 times on 32 block tables (as 32 layers would), over split counts, tiles, warps
              and pipeline stages
Usage: python benchmarks/decode_profile.py OUT_DIR [sections...]
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_bench import ROOT, abort_all, copy_bandwidth, engine, fake_prefilled  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402

from pagefleet.worker.core.sampling_params import SamplingParams  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
SECTIONS = sys.argv[2:] or ["breakdown", "attention"]
RESULTS: dict = {}

KINDS = [  # first match wins
    ("attention", r"_decode_kernel|_decode_reduce|_prefill_kernel"),
    ("kv write", r"write_kv"),
    ("norm", r"rms"),
    ("rope", r"rope"),
    ("silu_mul", r"silu"),
    ("fp8 quantise", r"quant"),
    ("gemm", r"gemm|gemv|xmma|cutlass|nvjet|splitk|sm90|matmul|_skinny"),
    ("copies", r"memcpy|memset|copy|Memcpy|Memset"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def save():
    with open(os.path.join(OUT, "decode_profile.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def profile_steps(eng, steps: int) -> dict:
    return profile_runs(eng.step, steps)


def profile_runs(fn, runs: int) -> dict:
    """fn's wall time per run, then its kernels under the profiler: device µs per run by kind and the top ones."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t) / runs * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith("ProfilerStep"):
            continue
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + us / runs
        top.append((us / runs, e.count // runs, e.key[:90]))
    top.sort(reverse=True)
    return {"wall_us": wall_us, "kernel_us": sum(by_kind.values()), "by_kind": by_kind, "top": top[:14]}


def breakdown(eng):
    eng.emit_partial = False
    rows = {}
    for b in (int(x) for x in os.environ.get("BREAKDOWN_BATCHES", "1,8,64,256").split(",")):
        for mode in ("graphs", "eager"):
            fake_prefilled(eng, b, 1024)
            for _ in range(3):
                eng.step()
            graphs = eng.runner.graphs
            if mode == "eager":
                eng.runner.graphs = None
            r = profile_steps(eng, 8)
            eng.runner.graphs = graphs
            abort_all(eng)
            rows[f"b{b}_{mode}"] = r
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]))
            print(f"batch {b} {mode}: wall {r['wall_us']:.0f} us/step, kernels {r['kernel_us']:.0f} us ({kinds})", flush=True)
            for us, count, name in r["top"][:8]:
                print(f"    {us:8.1f} us  x{count:<4d} {name}", flush=True)
    RESULTS["breakdown"] = rows
    save()


def mixed(eng):
    from pagefleet.worker.entrypoints.cli.bench_throughput import draw_requests, run_engine

    rows = {}
    for n, seed in ((256, 0), (2048, 1)):
        r = run_engine(eng, draw_requests(n, seed, (64, 1024), (32, 512), 128256), warmup=False)
        rows[f"{n}_seed{seed}"] = r
        print(f"mixed {n} (seed {seed}): {r['output_tok_per_s']:.1f} output tok/s, {r['seconds']:.1f}s, KV waste {100 * r['kv_waste']:.2f} %", flush=True)
    RESULTS["mixed"] = rows
    save()


def drain(eng):
    while eng.has_unfinished_requests() or eng.pending is not None:
        eng.step()


def prefill(eng):
    rng = random.Random(0)
    rows = {}
    model = eng.runner.model
    # FP8: each step with the norms and activation quantising for the GEMMs (fused) and without, side by side
    variants = (True, False) if model.fp8_weights else (None,)
    for budget, fused in ((b, f) for b in (564, 8192, 16384) for f in variants):  # one prompt (concurrency 1's TTFT), then full budgets
        if fused is not None:
            model.fuse_fp8_quantisation = fused
        n = min(budget, eng.config.max_num_batched_tokens) // 564

        def one_prompt_step():  # fresh random prompts each time: no prefix-cache hits
            for _ in range(n):
                eng.add_request(f"pf-{rng.random()}", [rng.randint(100, 119999) for _ in range(564)],
                                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False))
            drain(eng)

        one_prompt_step()  # compile this shape's kernels
        r = profile_runs(one_prompt_step, 3)
        r["tokens"] = n * 564
        r["us_per_token"] = r["wall_us"] / r["tokens"]
        label = str(budget) if fused is None else f"{budget}_{'fused' if fused else 'unfused'}"
        rows[label] = r
        kinds = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]))
        print(f"prompt step of {r['tokens']} tokens{'' if fused is None else (' fused' if fused else ' unfused')}: wall {r['wall_us'] / 1e3:.1f} ms ({r['us_per_token']:.2f} us/token), "
              f"kernels {r['kernel_us'] / 1e3:.1f} ms ({kinds})", flush=True)
        for us, count, name in r["top"][:12]:
            print(f"    {us / 1e3:8.2f} ms  x{count:<4d} {name}", flush=True)
    if model.fp8_weights:
        del model.fuse_fp8_quantisation  # back to the class default
    RESULTS["prefill"] = rows
    save()


def trace(eng):
    """Mixed 256 with each step's record kept: where the wall time goes (prompt steps; decode steps by batch)."""
    from pagefleet.worker.entrypoints.cli.bench_throughput import draw_requests, run_engine

    eng.recent_steps = collections.deque(maxlen=1 << 20)
    r = run_engine(eng, draw_requests(256, 0, (64, 1024), (32, 512), 128256), warmup=False)
    steps = list(eng.recent_steps)
    decode_bounds = [(f"decode {lo + 1}-{hi}", hi) for lo, hi in ((0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512))]
    buckets = {k: [0, 0.0, 0, 0] for k in ["prompt"] + [name for name, _ in decode_bounds]}
    for s in steps:
        key = "prompt" if s.num_prefill_tokens else next(name for name, hi in decode_bounds if s.num_seqs <= hi)
        b = buckets[key]
        b[0] += 1
        b[1] += s.duration_s
        b[2] += s.num_prefill_tokens
        b[3] += s.num_decode_tokens
    rows = {k: {"steps": c, "seconds": t, "prompt_tokens": p, "decode_tokens": d} for k, (c, t, p, d) in buckets.items()}
    print(f"mixed 256: {r['output_tok_per_s']:.1f} output tok/s in {r['seconds']:.2f}s, {len(steps)} steps recorded "
          f"(sum of step records {sum(s.duration_s for s in steps):.2f}s)", flush=True)
    for k, v in rows.items():
        if v["steps"]:
            print(f"  {k:15s} {v['steps']:5d} steps {v['seconds']:6.2f}s ({1e3 * v['seconds'] / v['steps']:.2f} ms each), "
                  f"prompt tokens {v['prompt_tokens']}, decode tokens {v['decode_tokens']}", flush=True)
    RESULTS["trace"] = {"run": r, "buckets": rows}
    save()


def time_graph(fn, reps=20) -> float:
    """Median µs of one replay of a graph that holds fn's launches."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def attention():
    from pagefleet.kernels.attention import decode_config, paged_decode_attention

    H, Hkv, D, bs, layers = 32, 8, 128, 16, 32
    copy_bw = copy_bandwidth(1 << 30)
    rows = []
    for B in (1, 4, 8, 16, 32):
        for ctx in (640, 1024, 4096):
            nb = -(-ctx // bs)
            total = layers * B * nb + 8
            kc = torch.randn(total, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            perm = torch.randperm(total, device="cuda")[: layers * B * nb].int().view(layers, B, nb)
            sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            kv_bytes = B * ctx * Hkv * D * 2 * 2

            def launches(**cfg):
                def fn():
                    for layer in range(layers):
                        paged_decode_attention(q, kc, vc, perm[layer], sl, max_seq_len=ctx, out=out, **cfg)
                return fn

            default_splits = decode_config(B, Hkv)[0]
            results = {"default": time_graph(launches()) / layers}
            for splits in (1, 2, 4, 8, 16):
                if splits > 1 and ctx // splits < 32:
                    continue
                for block_n in (32, 64, 128):
                    for warps in (4, 8):
                        for stages in (1, 2, 3):
                            cfg = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
                            try:
                                us = time_graph(launches(**cfg)) / layers
                            except Exception as e:  # a tile that does not fit: skip it
                                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                                continue
                            results[f"splits={splits},block_n={block_n},warps={warps},stages={stages}"] = us
            best = min((v, k) for k, v in results.items())
            row = {"batch": B, "context": ctx, "default_splits": default_splits, "default_us": results["default"],
                   "best_us": best[0], "best": best[1], "floor_us": kv_bytes / copy_bw * 1e6, "all_us": results,
                   "by_splits": {s: min(v for k, v in results.items() if k.startswith(f"splits={s},")) for s in (1, 2, 4, 8, 16)
                                 if any(k.startswith(f"splits={s},") for k in results)}}
            rows.append(row)
            print(f"attention b={B} ctx={ctx}: default ({default_splits} splits) {row['default_us']:.1f} us, best {best[0]:.1f} us "
                  f"[{best[1]}], floor {row['floor_us']:.1f} us; by splits " +
                  " ".join(f"{s}:{v:.1f}" for s, v in row["by_splits"].items()), flush=True)
            kc = vc = perm = None  # free this shape's caches before the next one
            torch.cuda.empty_cache()
    RESULTS["attention"] = rows
    save()


def main():
    os.makedirs(OUT, exist_ok=True)
    eng = None
    for name, fn in (("attention", attention), ("breakdown", breakdown), ("prefill", prefill), ("trace", trace),
                     ("mixed", mixed)):
        if name not in SECTIONS:
            continue
        print(f"\n=== {name}", flush=True)
        start = time.time()
        if name != "attention" and eng is None:
            eng = engine(make_checkpoint("llama-3.1-8b", f"{ROOT}/llama-3.1-8b"),
                         quantization="fp8" if "fp8" in SECTIONS else None)
            print(f"engine up in {time.time() - start:.1f}s", flush=True)
        fn(eng) if name != "attention" else fn()
        print(f"=== {name} took {time.time() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
