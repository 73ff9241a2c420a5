"""Check every kernel against its reference on real shapes in bf16, then time them on the GPU.

  python3 benchmarks/kernels_bench.py OUT_DIR            # on the H200: checks, ceilings, sweeps, table
  TRITON_INTERPRET=1 python3 benchmarks/kernels_bench.py OUT_DIR --dry-run   # CPU: tiny shapes, exercises the code
  --kv-cache-dtype fp8: the decode section reads an e4m3 cache (the engine's --kv-cache-dtype fp8), with its defaults

Decode attention is reported as bytes of K/V read / time / measured device copy bandwidth; prefill
attention as causal TFLOP/s / measured bf16 matmul TFLOP/s. Writes OUT_DIR/kernels.md (the table) and
OUT_DIR/kernels_sweep.json (every configuration timed); OUT_DIR defaults to $OUT, as in the other benchmarks.
Each kernel module is called directly (pagefleet.kernels.attention, ...), its plain-torch twin from
pagefleet.kernels.reference. Over 300 lines on purpose: one script checks and times every kernel in one GPU run.
"""
import argparse
import json
import math
import os
import sys
import time
import traceback
from functools import partial

import torch

import pagefleet.kernels.activation as ACT
import pagefleet.kernels.attention as A
import pagefleet.kernels.fp8 as FP8
import pagefleet.kernels.kv_cache as KV
import pagefleet.kernels.norm as NORM
import pagefleet.kernels.prefill_attention as PA
import pagefleet.kernels.reference as R
import pagefleet.kernels.rope as ROPE

p = argparse.ArgumentParser()
p.add_argument("out_dir", nargs="?", default=os.environ.get("OUT"), help="gets kernels.md and kernels_sweep.json")
p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
p.add_argument("--no-sweep", action="store_true", help="time the default heuristics only")
p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the decode section's cache")
args = p.parse_args()
DRY = args.dry_run
DEV = "cpu" if DRY else "cuda"
DT = torch.float32 if DRY else torch.bfloat16  # the interpreter mishandles bf16 arithmetic
if not args.out_dir:
    p.error("give OUT_DIR (or set $OUT): the results are written there")
OUT = args.out_dir
KV_DT = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DT
H, HKV, D = (8, 2, 32) if DRY else (32, 8, 128)  # Llama-3.1-8B attention shape
HIDDEN, INTER = (64, 96) if DRY else (4096, 14336)
results = {"checks": [], "decode": [], "prefill": [], "small": [], "ceilings": {}}
failures = []


def bench(fn):
    """Median milliseconds. Triton's do_bench: CUDA events, L2 flushed between runs."""
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def rel_err(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def poison():
    """Fill freed allocator blocks with NaN so an output a kernel forgets to write shows up."""
    if not DRY:
        torch.empty(1 << 28, dtype=torch.float16, device=DEV).fill_(float("nan"))


def check(name, err, tol):
    ok = err <= tol
    results["checks"].append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        failures.append(name)


def section(fn):
    """Run one part; a failure is reported and the rest still runs (device time is scarce)."""
    print(f"== {fn.__name__}", flush=True)
    try:
        fn()
    except Exception:
        traceback.print_exc()
        failures.append(fn.__name__)
    return fn


def make_paged(seq_lens, block_size, num_kv_heads=HKV, extra_blocks=7):
    """Random K/V in shuffled blocks (never contiguous), a block table padded with -1."""
    nbs = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(nbs) + extra_blocks
    perm = torch.randperm(num_blocks, device=DEV).int()
    bt = torch.full((len(seq_lens), max(nbs) + 2), -1, dtype=torch.int32, device=DEV)
    i = 0
    for s, nb in enumerate(nbs):
        bt[s, :nb] = perm[i: i + nb]
        i += nb
    shape = (num_blocks, block_size, num_kv_heads, D)
    kc, vc = torch.randn(shape, device=DEV).to(DT), torch.randn(shape, device=DEV).to(DT)
    return kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


# ---------------------------------------------------------------- ceilings


@section
def ceilings():
    n = (1 << 16) if DRY else (1 << 30)  # 2 GiB of bf16 each way
    a = torch.randn(n, device=DEV).to(DT)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    results["ceilings"]["copy_TBps"] = 2 * a.numel() * a.element_size() / ms / 1e9
    m = 128 if DRY else 8192
    x, y = torch.randn(m, m, device=DEV).to(DT), torch.randn(m, m, device=DEV).to(DT)
    ms = bench(lambda: x @ y)
    results["ceilings"]["matmul_TFLOPs"] = 2 * m**3 / ms / 1e9
    print(f"  copy {results['ceilings']['copy_TBps']:.2f} TB/s (read+write), "
          f"bf16 matmul {results['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


# ---------------------------------------------------------------- correctness on real shapes


@section
def checks():
    tol = 2e-5 if DRY else 1e-2
    gen_lens = lambda n, hi: torch.randint(1, hi + 1, (n,)).tolist()  # noqa: E731
    # KV write: 10% padding slots, non-contiguous target slots, k/v as views of a fused qkv
    T = 64 if DRY else 4096
    for bs in (16, 32):
        nblk = T // bs * 2
        kc, vc = torch.randn(nblk, bs, HKV, D, device=DEV).to(DT), torch.randn(nblk, bs, HKV, D, device=DEV).to(DT)
        slots = torch.randperm(nblk * bs, device=DEV)[:T]
        slots[torch.rand(T, device=DEV) < 0.1] = -1
        qkv = torch.randn(T, (H + 2 * HKV) * D, device=DEV).to(DT)
        k, v = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D), qkv[:, (H + HKV) * D:].view(T, HKV, D)
        kr, vr = kc.clone(), vc.clone()
        KV.write_kv_cache(k, v, kc, vc, slots)
        R.write_kv_cache(k, v, kr, vr, slots)
        check(f"write_kv_cache bs={bs} (exact)", 0.0 if torch.equal(kc, kr) and torch.equal(vc, vr) else 1.0, 0)
    # decode: mixed lengths, GQA 4 and 1, block 16 / 32, split paths forced and automatic
    B, hi = (6, 100) if DRY else (64, 8192)
    for bs in (16, 32):
        for heads in (H, HKV):
            for splits in (None, 1, 7):
                lens = gen_lens(B, hi)
                kc, vc, bt, sl = make_paged(lens, bs)
                q = torch.randn(B, heads, D, device=DEV).to(DT)
                out = torch.full_like(q, float("nan"))
                A.paged_decode_attention(q, kc, vc, bt, sl, out=out, num_splits=splits, block_n=16 if DRY else None)
                ref = R.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, sl)
                check(f"decode bs={bs} group={heads // HKV} splits={splits or 'auto'}", rel_err(out, ref), tol)
    # prefill / chunked prefill / mixed: full prompt, chunk after a cached prefix, decode tokens, tiny chunk
    big = 40 if DRY else 4096
    q_lens = [big, big // 4, 1, 1, 1, 37 if not DRY else 5, 0]
    prefixes = [0, 3 * big // 4, big // 2, 5, big, 100 if not DRY else 11, 9]
    for bs in (16, 32):
        for heads in (H, HKV):
            lens = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
            kc, vc, bt, sl = make_paged(lens, bs)
            cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
            q = torch.randn(sum(q_lens), heads, D, device=DEV).to(DT)
            out = torch.full_like(q, float("nan"))
            PA.paged_prefill_attention(q, kc, vc, bt, sl, cu, out=out, block_m=16 if DRY else None,
                                      block_n=16 if DRY else None)
            ref = R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, sl, cu)
            check(f"prefill bs={bs} group={heads // HKV} mixed", rel_err(out, ref), tol)
    # norms: hidden rows, fused add (residual exact), Qwen3 per-head norm on a strided view
    x, r = torch.randn(T, HIDDEN, device=DEV).to(DT), torch.randn(T, HIDDEN, device=DEV).to(DT)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEV)).to(DT)
    poison()
    check("rms_norm", rel_err(NORM.rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5)), tol)
    poison()
    n, res = NORM.fused_add_rms_norm(x, r, w, 1e-5)
    n_ref, res_ref = R.fused_add_rms_norm(x, r, w, 1e-5)
    check("fused_add_rms_norm", rel_err(n, n_ref), tol)
    check("fused_add_rms_norm residual (exact)", 0.0 if torch.equal(res, res_ref) else 1.0, 0)
    qkv = torch.randn(T, (H + 2 * HKV) * D, device=DEV).to(DT)
    qh, wd = qkv[:, : H * D].view(T, H, D), (1 + 0.1 * torch.randn(D, device=DEV)).to(DT)
    poison()
    check("rms_norm per-head strided", rel_err(NORM.rms_norm(qh, wd, 1e-6), R.rms_norm(qh, wd, 1e-6)), tol)
    # RoPE with llama3 scaling, positions up to 8k, q/k as views of a fused qkv; and partial rotary
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    kh = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    for rot in (D, D // 2):
        cache = R.rope_cos_sin_cache(rot, 8192, 500000.0, scaling, torch.float32, DEV)
        poison()
        got, exp = ROPE.apply_rope(qh, kh, pos, cache), R.apply_rope(qh, kh, pos, cache)
        check(f"rope rot={rot} llama3", max(rel_err(got[0], exp[0]), rel_err(got[1], exp[1])), tol)
    xm = torch.randn(T, 2 * INTER, device=DEV).to(DT)
    poison()
    check("silu_and_mul", rel_err(ACT.silu_and_mul(xm), R.silu_and_mul(xm)), tol)
    if DRY:
        return  # the interpreter's e4m3 cast truncates; _scaled_mm needs a GPU
    xq = torch.randn(T, HIDDEN, device=DEV).to(DT) * torch.rand(T, 1, device=DEV).to(DT) * 10
    poison()
    q8, s8 = FP8.quantize_fp8_per_token(xq)
    q8r, s8r = R.quantize_fp8_per_token(xq)
    mismatch = (q8.float() != q8r.float()).float().mean().item()
    check("fp8 quant scales", rel_err(s8, s8r), 1e-6)
    check("fp8 quant values (fraction differing)", mismatch, 1e-4)
    wt = torch.randn(INTER, HIDDEN, device=DEV).to(DT) * 0.02
    w8, ws = R.quantize_weight_fp8(wt)
    y = FP8.fp8_linear(xq, w8, ws)
    check("fp8_linear vs dequantised reference", rel_err(y, R.fp8_linear(xq, w8, ws)), tol)
    check("fp8_linear vs bf16 matmul (quantisation error)", rel_err(y, xq.float() @ wt.float().t()), 0.1)


# ---------------------------------------------------------------- decode attention


DECODE_CONFIGS = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 4)]


@section
def decode():
    copy_bw = results["ceilings"].get("copy_TBps", 1.0)
    batches, ctxs = ((2, 4), (64, 128)) if DRY else ((64, 128, 256), (1024, 4096, 8192))
    block_size = 16
    nb_max = max(batches) * max(ctxs) // block_size
    # One cache for every shape; each shape takes its blocks from a random permutation.
    kc = torch.randn(nb_max, block_size, HKV, D, device=DEV).to(KV_DT)
    vc = torch.randn(nb_max, block_size, HKV, D, device=DEV).to(KV_DT)
    small_batches = [(1, 128)] if DRY else [(1, 8192), (8, 8192), (32, 4096)]  # where split-KV (flash-decoding) matters
    shapes = [(B, ctx) for B in batches for ctx in ctxs] + small_batches
    for B, ctx in shapes:
        if True:
            nb = ctx // block_size
            bt = torch.randperm(nb_max, device=DEV)[: B * nb].view(B, nb).int()
            sl = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
            q = torch.randn(B, H, D, device=DEV).to(DT)
            out = torch.empty_like(q)
            kv_bytes = 2 * B * ctx * HKV * D * kc.element_size()
            default_ms = bench(partial(A.paged_decode_attention, q, kc, vc, bt, sl, max_seq_len=ctx, out=out))
            auto = A.decode_config(B, HKV, kc.element_size() == 1)[0]
            best = (default_ms, "auto", auto)
            configs = [] if args.no_sweep else [(16, 4, 2)] if DRY else DECODE_CONFIGS
            split_choices = (1, 2, 4, 8)
            if (B, ctx) in small_batches:  # default tiles; sweep the split count only
                configs, split_choices = [(16 if DRY else 64, 4, 2)], (1, 2, 4, 8, 16, 32, 64)
            for bn, w, st in configs:
                for splits in split_choices:
                    if B * HKV * splits > 8192 or ctx // splits < bn:
                        continue
                    kw = dict(block_n=bn, num_warps=w, num_stages=st, num_splits=splits)
                    ms = bench(partial(A.paged_decode_attention, q, kc, vc, bt, sl, max_seq_len=ctx, out=out, **kw))
                    results["decode"].append({"B": B, "ctx": ctx, **kw, "ms": ms})
                    if ms < best[0]:
                        best = (ms, kw, splits)
            # the fastest configuration must be right too: first 8 sequences against the reference
            kw = best[1] if isinstance(best[1], dict) else {}
            out.fill_(float("nan"))
            A.paged_decode_attention(q, kc, vc, bt, sl, max_seq_len=ctx, out=out, **kw)
            ref = R.paged_decode_attention(q[:8].float(), kc.float() if DRY else kc, vc.float() if DRY else vc,
                                           bt[:8], sl[:8]).float()
            check(f"decode B={B} ctx={ctx} best config", rel_err(out[:8], ref), 2e-5 if DRY else 1e-2)
            row = {"B": B, "ctx": ctx, "MB": kv_bytes / 1e6, "default_ms": default_ms, "default_splits": auto,
                   "default_pct": kv_bytes / default_ms / 1e9 / copy_bw * 100, "best_ms": best[0],
                   "best_cfg": best[1], "best_pct": kv_bytes / best[0] / 1e9 / copy_bw * 100}
            results["decode"].append({"summary": row})
            print(f"  B={B:4d} ctx={ctx:5d}: default {default_ms * 1e3:7.1f} us ({row['default_pct']:5.1f} %, "
                  f"splits {auto}), best {best[0] * 1e3:7.1f} us ({row['best_pct']:5.1f} %) {best[1]}", flush=True)


# ---------------------------------------------------------------- prefill attention


PREFILL_CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4),
                   (256, 64, 8, 3), (256, 128, 8, 2), (64, 64, 4, 3)]


@section
def prefill():
    mm = results["ceilings"].get("matmul_TFLOPs", 1.0)
    n = 64 if DRY else 4096
    cases = {  # name: (q_lens, prefixes)
        f"{n} tokens, 1 prompt": ([n], [0]),
        f"{n} tokens, 4 prompts": ([n // 4] * 4, [0] * 4),
        f"{n // 2}-token chunk after {n // 2} cached": ([n // 2], [n // 2]),
    }
    for name, (q_lens, prefixes) in cases.items():
        lens = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
        kc, vc, bt, sl = make_paged(lens, 16)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        q = torch.randn(sum(q_lens), H, D, device=DEV).to(DT)
        out = torch.empty_like(q)
        # causal: query i of a sequence sees prefix + i + 1 keys; 2 matmuls x 2 flop per multiply-add
        flops = sum(4 * H * D * (p * ql + ql * (ql + 1) // 2) for ql, p in zip(q_lens, prefixes, strict=True))
        default_ms = bench(partial(PA.paged_prefill_attention, q, kc, vc, bt, sl, cu, out=out))
        best = (default_ms, "default")
        for bm, bn, w, st in ([] if args.no_sweep else [(16, 16, 4, 2)] if DRY else PREFILL_CONFIGS):
            kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            try:
                ms = bench(partial(PA.paged_prefill_attention, q, kc, vc, bt, sl, cu, out=out, **kw))
            except Exception as e:  # e.g. out of shared memory for this tile
                print(f"  {kw}: {type(e).__name__}", flush=True)
                continue
            results["prefill"].append({"case": name, **kw, "ms": ms})
            if ms < best[0]:
                best = (ms, kw)
        kw = best[1] if isinstance(best[1], dict) else {}
        out.fill_(float("nan"))
        PA.paged_prefill_attention(q, kc, vc, bt, sl, cu, out=out, **kw)
        check(f"prefill '{name}' best config",
              rel_err(out, R.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, sl, cu)),
              2e-5 if DRY else 1e-2)
        sdpa_ms = None
        if len(q_lens) == 1 and prefixes[0] == 0 and not DRY:  # cuDNN / flash on contiguous K/V, for scale
            qd = q.transpose(0, 1).unsqueeze(0)
            kd = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
            vd = torch.randn_like(kd)
            sdpa_ms = bench(partial(torch.nn.functional.scaled_dot_product_attention, qd, kd, vd, is_causal=True,
                                      enable_gqa=True))
        row = {"case": name, "default_ms": default_ms, "default_TFLOPs": flops / default_ms / 1e9,
               "best_ms": best[0], "best_cfg": best[1], "best_TFLOPs": flops / best[0] / 1e9,
               "best_pct_matmul": flops / best[0] / 1e9 / mm * 100,
               "sdpa_TFLOPs": flops / sdpa_ms / 1e9 if sdpa_ms else None}
        results["prefill"].append({"summary": row})
        print(f"  {name}: default {row['default_TFLOPs']:.0f} TFLOP/s, best {row['best_TFLOPs']:.0f} TFLOP/s "
              f"({row['best_pct_matmul']:.0f} % of matmul) {best[1]}; torch sdpa (dense) "
              f"{row['sdpa_TFLOPs'] or 0:.0f}", flush=True)


# ---------------------------------------------------------------- small kernels


@section
def small():
    copy_bw = results["ceilings"].get("copy_TBps", 1.0)
    T = 64 if DRY else 8192
    e = 4 if DRY else 2
    x, r = torch.randn(T, HIDDEN, device=DEV).to(DT), torch.randn(T, HIDDEN, device=DEV).to(DT)
    w = torch.randn(HIDDEN, device=DEV).to(DT)
    qkv = torch.randn(T, (H + 2 * HKV) * D, device=DEV).to(DT)
    qh, kh, vh = (qkv[:, : H * D].view(T, H, D), qkv[:, H * D:(H + HKV) * D].view(T, HKV, D),
                  qkv[:, (H + HKV) * D:].view(T, HKV, D))
    cache = R.rope_cos_sin_cache(D, 8192, 500000.0, None, torch.float32, DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    kc = torch.empty(T // 16 * 2, 16, HKV, D, device=DEV, dtype=DT)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=DEV)[:T]
    xm = torch.randn(T, 2 * INTER, device=DEV).to(DT)
    cases = [  # name, fn, bytes moved (each input read once, each output written once)
        ("write_kv_cache", lambda: KV.write_kv_cache(kh, vh, kc, vc, slots), 4 * T * HKV * D * e),
        ("rms_norm", lambda: NORM.rms_norm(x, w), 2 * T * HIDDEN * e),
        ("fused_add_rms_norm", lambda: NORM.fused_add_rms_norm(x, r, w), 4 * T * HIDDEN * e),
        ("rms_norm per-head (q)", lambda: NORM.rms_norm(qh, w[:D]), 2 * T * H * D * e),
        ("apply_rope", lambda: ROPE.apply_rope(qh, kh, pos, cache), 2 * T * (H + HKV) * D * e + T * D * 4),
        ("silu_and_mul", lambda: ACT.silu_and_mul(xm), 3 * T * INTER * e),
    ]
    if not DRY:
        cases.append(("fp8 quantize per token", lambda: FP8.quantize_fp8_per_token(x), 3 * T * HIDDEN))
    for name, fn, nbytes in cases:
        ms = bench(fn)
        row = {"name": name, "ms": ms, "TBps": nbytes / ms / 1e9, "pct": nbytes / ms / 1e9 / copy_bw * 100}
        results["small"].append(row)
        print(f"  {name}: {ms * 1e3:.1f} us, {row['TBps']:.2f} TB/s ({row['pct']:.0f} % of copy)", flush=True)
    if not DRY:
        wt = torch.randn(INTER, HIDDEN, device=DEV).to(DT) * 0.02
        w8, ws = R.quantize_weight_fp8(wt)
        flops = 2 * T * HIDDEN * INTER
        ms8 = bench(lambda: FP8.fp8_linear(x, w8, ws))
        ms16 = bench(lambda: x @ wt.t())
        results["small"].append({"name": "fp8_linear", "ms": ms8, "TFLOPs": flops / ms8 / 1e9,
                                 "bf16_TFLOPs": flops / ms16 / 1e9})
        print(f"  fp8_linear {T}x{HIDDEN}x{INTER}: {flops / ms8 / 1e9:.0f} TFLOP/s "
              f"(bf16 matmul same shape {flops / ms16 / 1e9:.0f})", flush=True)


def gdn_case(name, B, T, hk, hv, dk, dv):
    """One layer's conv and rule, B sequences of T // B tokens each (decode when T == B)."""
    import pagefleet.kernels.causal_conv1d as CONV
    import pagefleet.kernels.gdn_chunk as CHUNK
    import pagefleet.kernels.gdn_recurrent as REC
    import pagefleet.kernels.gdn_reference as GR

    conv = 2 * hk * dk + hv * dv
    cu = None if T == B else torch.arange(0, T + 1, T // B, dtype=torch.int32, device=DEV)
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    proj = torch.randn(T, conv + 2 * hv, device=DEV).to(DT)
    x, a, b = proj[:, :conv], proj[:, conv: conv + hv], proj[:, conv + hv:]
    w = torch.randn(conv, 4, device=DEV).to(DT) * 0.5
    A_log, dt_bias = torch.rand(hv, device=DEV).mul(16).add(1).log(), torch.randn(hv, device=DEV)
    cs = torch.randn(B, conv, 3, device=DEV).to(DT)
    ss = torch.randn(B, hv, dk, dv, device=DEV) * 0.05
    y = GR.causal_conv1d(x, w, cs.clone(), slots, cu)
    q, k, v = (y[:, : hk * dk].view(T, hk, dk), y[:, hk * dk: 2 * hk * dk].view(T, hk, dk),
               y[:, 2 * hk * dk:].view(T, hv, dv))

    def rule_ref(state):
        g, beta = GR.gdn_gating(A_log, a, dt_bias, b)
        if cu is None:
            return GR.recurrent_gated_delta_rule(q, k, v, g, beta, state, slots)
        return GR.chunk_gated_delta_rule(q, k, v, g, beta, state, slots, cu)

    def rule(state):
        if cu is None:
            return REC.recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots)
        return CHUNK.chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu)

    check(f"gdn conv {name}", rel_err(CONV.causal_conv1d(x, w, cs.clone(), slots, cu), y), 1.5e-2)
    s1, s2 = ss.clone(), ss.clone()
    check(f"gdn rule {name}", rel_err(rule(s1), rule_ref(s2)), 1.5e-2)
    check(f"gdn rule {name} state", rel_err(s1, s2), 1e-2)
    timed = (("conv", partial(CONV.causal_conv1d, x, w, cs, slots, cu), partial(GR.causal_conv1d, x, w, cs, slots, cu)),
             ("rule", partial(rule, ss), partial(rule_ref, ss)))
    for part, fn, fn_ref in timed:
        row = {"name": f"{part} {name}", "B": B, "T": T, "ms": bench(fn), "ref_ms": bench(fn_ref)}
        results["gdn"].append(row)
        print(f"  gdn {part} {name} (B={B}, T={T}): {row['ms'] * 1e3:.1f} us, reference "
              f"{row['ref_ms'] * 1e3:.1f} us", flush=True)


@section
def gdn():
    """Gated DeltaNet at Qwen3.6-27B's shape (16 q/k heads, 48 value heads of 128, conv 4): kernel against
    reference (gdn_reference) in error and time, batch-64 decode and one 4k-token prefill, per layer."""
    shape = (2, 4, 16, 16) if DRY else (16, 48, 128, 128)
    results["gdn"] = []
    gdn_case("decode", 8 if DRY else 64, 8 if DRY else 64, *shape)
    gdn_case("prefill", 1, 70 if DRY else 4096, *shape)

# ---------------------------------------------------------------- table


def config_text(cfg):
    return cfg if isinstance(cfg, str) else ", ".join(f"{k}={v}" for k, v in cfg.items())


def table():
    c = results["ceilings"]
    lines = [f"Device: {torch.cuda.get_device_name() if not DRY else 'CPU (dry run)'}; torch {torch.__version__}; "
             f"measured copy {c.get('copy_TBps', 0):.2f} TB/s (read+write), bf16 matmul "
             f"{c.get('matmul_TFLOPs', 0):.0f} TFLOP/s.", "",
             f"Decode attention (H={H}, Hkv={HKV}, D={D}, block 16, {str(KV_DT).removeprefix('torch.')} cache), "
             "K/V bytes / time / copy bandwidth:", "",
             "| batch | context | K/V MB | default µs | default % | splits | best µs | best % | best config |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in results["decode"]:
        if "summary" in d:
            s = d["summary"]
            cfg = config_text(s["best_cfg"])
            lines.append(f"| {s['B']} | {s['ctx']} | {s['MB']:.0f} | {s['default_ms'] * 1e3:.1f} "
                         f"| {s['default_pct']:.1f} | {s['default_splits']} | {s['best_ms'] * 1e3:.1f} "
                         f"| {s['best_pct']:.1f} | {cfg} |")
    lines += ["", "Prefill attention (causal, paged, bf16), TFLOP/s and % of the measured matmul rate:", "",
              "| case | default TFLOP/s | best TFLOP/s | best % of matmul | best config | torch sdpa dense |",
              "|---|---|---|---|---|---|"]
    for d in results["prefill"]:
        if "summary" in d:
            s = d["summary"]
            cfg = config_text(s["best_cfg"])
            sd = f"{s['sdpa_TFLOPs']:.0f}" if s["sdpa_TFLOPs"] else "-"
            lines.append(f"| {s['case']} | {s['default_TFLOPs']:.0f} | {s['best_TFLOPs']:.0f} | "
                         f"{s['best_pct_matmul']:.0f} | {cfg} | {sd} |")
    lines += ["", "Small kernels (8192 tokens, Llama-3.1-8B dims):", "", "| kernel | µs | TB/s | % of copy |",
              "|---|---|---|---|"]
    for s in results["small"]:
        if "TBps" in s:
            lines.append(f"| {s['name']} | {s['ms'] * 1e3:.1f} | {s['TBps']:.2f} | {s['pct']:.0f} |")
        else:
            lines.append(f"| {s['name']} | {s['ms'] * 1e3:.1f} | {s['TFLOPs']:.0f} TFLOP/s "
                         f"(bf16 {s['bf16_TFLOPs']:.0f}) | - |")
    if results.get("gdn"):
        lines += ["", "Gated DeltaNet, one layer at Qwen3.6-27B's shape (bf16, fp32 state), kernel vs reference:", "",
                  "| case | batch | tokens | kernel µs | reference µs |", "|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['B']} | {r['T']} | {r['ms'] * 1e3:.1f} | {r['ref_ms'] * 1e3:.1f} |"
                  for r in results["gdn"]]
    n_ok = sum(c["ok"] for c in results["checks"])
    lines += ["", f"Checks: {n_ok}/{len(results['checks'])} passed" + (f"; failed: {failures}" if failures else "")]
    return "\n".join(lines)


md = table()
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "kernels.md"), "w") as f:
    f.write(md + "\n")
with open(os.path.join(OUT, "kernels_sweep.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
print("\n" + md)
sys.exit(1 if failures else 0)
