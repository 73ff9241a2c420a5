"""The Gated DeltaNet kernels' tiles, swept at Qwen3.6-27B's shape on the GPU: the decode rule, then the chunked rule.

A decode step reads and writes every running sequence's [48, 128, 128] state in each of the 48 DeltaNet layers:
at 256 sequences in bf16 that is 0.8 GB a layer, and the rule is 40 % of the 27B decode step
(`step_breakdown.py /dev/shm/q36 --mixed-draw 0 --profile 10`: 16.9 of ~42 ms at <= 256 rows, 2.2 TB/s).
This times kernels/gdn_recurrent.py per (value columns a program, warps) for bf16 and fp32 states at batch 64,
256 and 376, checks each variant against gdn_reference, and prints µs a layer and the state bandwidth. A two-pass
kernel over state slices lost this sweep on an H100 (fp32 state, batch 256: 729.2 µs a layer, 2.21 TB/s, at its best
against the one-tile kernel's 572.8 µs, 2.81 TB/s) and lives in git history at commit 83c8c07.

The chunked rule (kernels/gdn_chunk.py) is ~25 % of a 27B prompt step's device time beside the GEMMs' ~70 %
(the same profile, 16,384-token steps). `--prefill` times its launch settings on a 16,384-token batch of the
mixed draw's lengths (64..1024), each checked against the reference first.

Usage: python3 benchmarks/gdn_tile_bench.py [--batches 64 256 376] [--bv 8 16 32 64] [--warps 1 2 4 8] [--prefill]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import torch
import triton

from pagefleet.kernels import gdn_chunk, gdn_recurrent
from pagefleet.kernels import gdn_reference as ref

HK, HV, DK, DV = 16, 48, 128, 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --dry-run under TRITON_INTERPRET=1
PREFILL_TOKENS = 16384
DRY = False  # --dry-run: two variants of each, tiny batches


def bench_ms(fn, warmup: int, rep: int) -> float:
    if DEV == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)
    start = time.perf_counter()  # the interpreter: one call, to see the script through
    fn()
    return (time.perf_counter() - start) * 1e3


def inputs(batch: int, slots: int, state_dtype: torch.dtype, gen: torch.Generator):
    dev = DEV
    qkv = torch.randn(batch, 2 * HK * DK + HV * DV, device=dev, generator=gen).bfloat16()
    q = qkv[:, :HK * DK].view(batch, HK, DK)
    k = qkv[:, HK * DK:2 * HK * DK].view(batch, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(batch, HV, DV)
    ab = torch.randn(batch, 2 * HV, device=dev, generator=gen).bfloat16()
    a, b = ab[:, :HV], ab[:, HV:]
    A_log = torch.rand(HV, device=dev, generator=gen).mul(16).add(1).log()
    dt_bias = torch.randn(HV, device=dev, generator=gen)
    state = (torch.randn(slots, HV, DK, DV, device=dev, generator=gen) * 0.05).to(state_dtype)
    order = torch.randperm(slots, device=dev, generator=gen)[:batch].int()
    return q, k, v, a, b, A_log, dt_bias, state, order


def prefill_inputs(lens: list[int], state_dtype: torch.dtype, gen: torch.Generator):
    q, k, v, a, b, A_log, dt_bias, state, _ = inputs(sum(lens), len(lens) + 4, state_dtype, gen)
    slots = torch.randperm(len(lens) + 4, device=DEV, generator=gen)[:len(lens)].int()
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)
    return q, k, v, a, b, A_log, dt_bias, state, slots, cu


def prefill_sweep() -> None:
    """The chunked rule's launch settings: each variant against the reference on 4 sequences, then timed on a
    16,384-token batch of mixed lengths."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    variants = [dict(zip(("state_bv", "state_warps", "prepare_warps"), c))
                for c in itertools.product((32, 64, 128), (2, 4, 8), (2, 4, 8))][:2 if DRY else None]
    default = {"state_bv": gdn_chunk.tiles(DK, DV)[1]["BV"], "state_warps": gdn_chunk.STATE_WARPS,
               "prepare_warps": gdn_chunk.PREPARE_WARPS}
    q, k, v, a, b, A_log, dt_bias, state, slots, cu = prefill_inputs([70, 1, 30] if DRY else [130, 64, 1, 300],
                                                                     torch.bfloat16, gen)
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    want_state = state.clone()
    want = ref.chunk_gated_delta_rule(q, k, v, g, beta, want_state, slots, cu)
    ok = []
    for var in variants:
        s = state.clone()
        try:
            o = gdn_chunk.chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, s, slots, cu, launch=var)
        except Exception as e:  # a tile past the shared memory a block may have does not launch
            print(f"  {var}: does not launch ({type(e).__name__})", flush=True)
            continue
        err = ((o.double() - want.double()).norm() / want.double().norm()).item()
        serr = ((s.double() - want_state.double()).norm() / want_state.double().norm()).item()
        if err < 1.5e-2 and serr < 1e-2:
            ok.append(var)
        else:
            print(f"  {var}: off the reference ({err:.3g}, state {serr:.3g})", flush=True)
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < PREFILL_TOKENS:
        lens.append(min(rng.randint(64, 1024), PREFILL_TOKENS - sum(lens)))
    args = prefill_inputs(lens, torch.bfloat16, gen)
    rows = []
    for var in ok:
        ms = bench_ms(lambda var=var: gdn_chunk.chunk_gated_delta_rule(*args, launch=var), warmup=5, rep=50)
        rows.append((var, ms))
        print(f"  prefill {var}: {ms * 1e3:.0f} us", flush=True)
    base = next((ms for var, ms in rows if var == default), None)
    best = min(rows, key=lambda r: r[1])
    print(f"\nchunked rule, {len(lens)} sequences of {PREFILL_TOKENS:,} tokens, one layer, bf16 state: "
          f"default {default} {base * 1e3 if base else float('nan'):.0f} us, best {best[0]} {best[1] * 1e3:.0f} us "
          f"({len(ok)} of {len(variants)} variants launch and match)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 376])
    p.add_argument("--bv", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prefill", action="store_true", help="then sweep the chunked rule's launch settings")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny batches, one call each")
    a = p.parse_args()
    if a.dry_run:
        global PREFILL_TOKENS, DRY, HK, HV, DK, DV  # the interpreter takes minutes a launch at the real shape
        PREFILL_TOKENS, DRY, a.batches, a.bv, a.warps = 300, True, [2], a.bv[:1], a.warps[:1]
        HK, HV, DK, DV = 2, 4, 32, 32
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        # each variant against the reference once, at a small batch (the reference is slow)
        q, k, v, aa, bb, A_log, dt_bias, state, order = inputs(32, 64, dtype, gen)
        g, beta = ref.gdn_gating(A_log, aa, dt_bias, bb)
        want_state = state.clone()
        want = ref.recurrent_gated_delta_rule(q, k, v, g, beta, want_state, order)
        bad = []
        for bv in a.bv:
            for w in a.warps:
                s = state.clone()
                o = gdn_recurrent.recurrent_gated_delta_rule(q, k, v, aa, bb, A_log, dt_bias, s, order, block_v=bv,
                                                             num_warps=w)
                err = ((o.double() - want.double()).norm() / want.double().norm()).item()
                serr = ((s.double() - want_state.double()).norm() / want_state.double().norm()).item()
                if not (err < 1.5e-2 and serr < 1e-2):
                    bad.append((bv, w, err, serr))
        if bad:
            raise SystemExit(f"variants off the reference ({dtype}): {bad}")
        print(f"{dtype}: every variant matches the reference", flush=True)
        for batch in a.batches:
            args = inputs(batch, batch + 8, dtype, gen)
            state = args[7]
            moved = 2 * batch * HV * DK * DV * state.element_size()
            for bv in a.bv:
                for w in a.warps:
                    ms = bench_ms(
                        lambda bv=bv, w=w, args=args: gdn_recurrent.recurrent_gated_delta_rule(
                            *args, block_v=bv, num_warps=w),
                        warmup=20, rep=100)
                    rows.append((str(dtype).removeprefix("torch."), batch, bv, w, ms * 1e3, moved / ms / 1e9))
                    print(f"  {rows[-1][0]} batch {batch} BV {bv} warps {w}: {ms * 1e3:.1f} us, "
                          f"{moved / ms / 1e9:.2f} TB/s", flush=True)
    print("\nbest per state dtype and batch, beside the default (gdn_recurrent.TILES):")
    print("| state | batch | default µs | best µs | best BV, warps | TB/s |\n|---|---|---|---|---|---|")
    for dtype in ("bfloat16", "float32"):
        for batch in a.batches:
            mine = [r for r in rows if r[0] == dtype and r[1] == batch]
            if not mine:
                continue
            best = min(mine, key=lambda r: r[4])
            base = next((r for r in mine if (r[2], r[3]) == gdn_recurrent.TILES[getattr(torch, dtype)]), None)
            print(f"| {dtype} | {batch} | {base[4]:.1f} | {best[4]:.1f} | {best[2]}, {best[3]} | {best[5]:.2f} |"
                  if base else f"| {dtype} | {batch} | - | {best[4]:.1f} | {best[2]}, {best[3]} | {best[5]:.2f} |")
    if a.prefill:
        prefill_sweep()


if __name__ == "__main__":
    main()
