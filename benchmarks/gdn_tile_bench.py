"""The Gated DeltaNet kernels' tiles, swept at Qwen3.6-27B's shape on the GPU: the decode rule, then the chunked rule.

A decode step reads and writes every running sequence's [48, 128, 128] state in each of the 48 DeltaNet layers:
at 256 sequences in bf16 that is 0.8 GB a layer, and the rule is 40 % of the 27B decode step
(`step_breakdown.py /dev/shm/q36 --mixed-draw 0 --profile 10`: 16.9 of ~42 ms at <= 256 rows, 2.2 TB/s).
This times kernels/gdn_recurrent.py per (value columns a program, warps) for bf16 and fp32 states at batch 64,
256 and 376, checks each variant against gdn_reference, and prints µs a layer and the state bandwidth. A two-pass
kernel over state slices lost this sweep on an H100 (fp32 state, batch 256: 729.2 µs a layer, 2.21 TB/s, at its best
against the one-tile kernel's 572.8 µs, 2.81 TB/s) and lives in git history at commit 83c8c07.

The chunked rule (kernels/gdn_chunk.py) was ~25 % of a 27B prompt step's device time beside the GEMMs' ~70 %
(the same profile, 16,384-token steps, fp32 operands then). `--prefill` times its launch settings on a
16,384-token batch of the mixed draw's lengths (64..1024), each checked against the reference first, beside
vLLM's own rule where vllm imports.

Usage: python3 benchmarks/gdn_tile_bench.py [--batches 64 256 376] [--bv 8 16 32 64] [--warps 1 2 4 8]
         [--prefill [--old OTHER_TREE/kernels/gdn_chunk.py] [--json OUT.json]]
"""

from __future__ import annotations

import argparse
import itertools
import json
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
PREFILL_DTYPE = torch.bfloat16  # --dry-run: fp16 (the interpreter's products on bf16 operands are wrong)


def bench_ms(fn, warmup: int, rep: int) -> float:
    if DEV == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep)
    start = time.perf_counter()  # the interpreter: one call, to see the script through
    fn()
    return (time.perf_counter() - start) * 1e3


def inputs(batch: int, slots: int, state_dtype: torch.dtype, gen: torch.Generator, dtype=torch.bfloat16):
    dev = DEV
    qkv = torch.randn(batch, 2 * HK * DK + HV * DV, device=dev, generator=gen).to(dtype)
    q = qkv[:, :HK * DK].view(batch, HK, DK)
    k = qkv[:, HK * DK:2 * HK * DK].view(batch, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(batch, HV, DV)
    ab = torch.randn(batch, 2 * HV, device=dev, generator=gen).to(dtype)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log = torch.rand(HV, device=dev, generator=gen).mul(16).add(1).log()
    dt_bias = torch.randn(HV, device=dev, generator=gen)
    state = (torch.randn(slots, HV, DK, DV, device=dev, generator=gen) * 0.05).to(state_dtype)
    order = torch.randperm(slots, device=dev, generator=gen)[:batch].int()
    return q, k, v, a, b, A_log, dt_bias, state, order


def prefill_inputs(lens: list[int], state_dtype: torch.dtype, gen: torch.Generator):
    q, k, v, a, b, A_log, dt_bias, state, _ = inputs(sum(lens), len(lens) + 4, state_dtype, gen, PREFILL_DTYPE)
    slots = torch.randperm(len(lens) + 4, device=DEV, generator=gen)[:len(lens)].int()
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)
    return q, k, v, a, b, A_log, dt_bias, state, slots, cu


PREFILL_VARIANTS = [  # (state_bv, state_warps, state_stages, prepare_warps)
    (64, 4, 2, 4), (64, 4, 1, 4), (64, 4, 3, 4), (64, 8, 2, 4), (32, 4, 2, 4), (32, 2, 2, 4), (128, 8, 1, 4),
    (64, 4, 2, 8),
]


def fla_rule():
    """vLLM's prefill rule (its copy of FLA's chunk_gated_delta_rule, the Triton backend) where vllm imports."""
    try:
        from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - no vLLM here: the sweep runs without the comparison
        print(f"  (no vLLM FLA rule to compare: {type(e).__name__}: {e})", flush=True)
        return None

    def run(q, k, v, a, b, A_log, dt_bias, state, slots, cu):
        # vLLM's path: gate, gather the slots' states ([N, Hv, Dv, Dk] there), the rule, scatter the final states
        g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
        init = state[slots.long()].transpose(-1, -2).contiguous()
        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=init,
                                          output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        state[slots.long()] = final.transpose(-1, -2).to(state.dtype)
        return o[0]
    return run


def prefill_sweep(old_path: str | None, json_out: str | None) -> None:
    """The chunked rule's launch settings: each variant against the reference on 4 sequences, then timed on a
    16,384-token batch of mixed lengths; the default, the best, the tree of --old and vLLM's rule also on a
    serving step's 8,192 tokens (prompts of 564)."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    keys = ("state_bv", "state_warps", "state_stages", "prepare_warps")
    variants = [dict(zip(keys, c)) for c in PREFILL_VARIANTS][:2 if DRY else None]
    default = {**{key: gdn_chunk.LAUNCH[key] for key in keys}, "state_stages": gdn_chunk.STATE_STAGES["half"]}
    if default not in variants:
        variants.insert(0, default)
    rules = {str(var): (lambda *x, var=var: gdn_chunk.chunk_gated_delta_rule(*x, launch=var)) for var in variants}
    if old_path:
        import importlib.util
        import sys
        spec = importlib.util.spec_from_file_location("pagefleet.kernels._old_gdn_chunk", old_path)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
        rules["--old"] = old.chunk_gated_delta_rule
    fla = fla_rule()
    if fla:
        rules["vLLM (FLA)"] = fla
    q, k, v, a, b, A_log, dt_bias, state, slots, cu = prefill_inputs([70, 1, 30] if DRY else [130, 64, 1, 300],
                                                                     torch.bfloat16, gen)
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    want_state = state.clone()
    want = ref.chunk_gated_delta_rule(q, k, v, g, beta, want_state, slots, cu)
    ok = []
    for name, rule in rules.items():
        s = state.clone()
        try:
            o = rule(q, k, v, a, b, A_log, dt_bias, s, slots, cu)
        except Exception as e:  # a tile past the shared memory a block may have does not launch
            print(f"  {name}: does not launch ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        err = ((o.double() - want.double()).norm() / want.double().norm()).item()
        serr = ((s.double() - want_state.double()).norm() / want_state.double().norm()).item()
        print(f"  {name}: error against the reference {err:.2e}, state {serr:.2e}", flush=True)
        if err < 1.5e-2 and serr < 1e-2:
            ok.append(name)
        else:
            print(f"  {name}: off the reference", flush=True)
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < PREFILL_TOKENS:
        lens.append(min(rng.randint(64, 1024), PREFILL_TOKENS - sum(lens)))
    serving = [564] * (PREFILL_TOKENS // 2 // 564) + [PREFILL_TOKENS // 2 % 564]
    mixed_args = prefill_inputs(lens, torch.bfloat16, gen)
    serving_args = prefill_inputs(serving, torch.bfloat16, gen)
    times = {}
    for name in ok:
        times[name] = bench_ms(lambda name=name: rules[name](*mixed_args), warmup=5, rep=50)
        print(f"  {name}: {times[name] * 1e3:.0f} us", flush=True)
    best = min((n for n in times if n.startswith("{")), key=times.get)
    print(f"\nchunked rule, one layer, bf16 state (µs; {len(ok)} of {len(rules)} variants launch and match):")
    print(f"| rule | {len(lens)} sequences, {sum(lens):,} tokens | {len(serving)} sequences, {sum(serving):,} tokens |")
    print("|---|---|---|")
    table = {}
    for name in dict.fromkeys([str(default), best, "--old", "vLLM (FLA)"]):
        if name in times:
            t2 = bench_ms(lambda name=name: rules[name](*serving_args), warmup=5, rep=50)
            table[name] = (round(times[name] * 1e3, 1), round(t2 * 1e3, 1))
            label = "default " + name if name == str(default) else ("best " + name if name == best else name)
            print(f"| {label} | {times[name] * 1e3:.0f} | {t2 * 1e3:.0f} |", flush=True)
    if json_out:
        launch = next(var for var in variants if str(var) == best)
        with open(json_out, "w") as f:
            json.dump({"best_launch": launch, "us": table, "all_mixed_us": {n: round(t * 1e3, 1)
                                                                           for n, t in times.items()}}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 376])
    p.add_argument("--bv", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prefill", action="store_true", help="then sweep the chunked rule's launch settings")
    p.add_argument("--old", default=None, help="with --prefill: a gdn_chunk.py of another tree, timed beside")
    p.add_argument("--json", default=None, help="with --prefill: write the timings and the best launch here")
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny batches, one call each")
    a = p.parse_args()
    if a.dry_run:
        global PREFILL_TOKENS, DRY, PREFILL_DTYPE, HK, HV, DK, DV  # the interpreter takes minutes a launch here
        PREFILL_TOKENS, DRY, a.batches, a.bv, a.warps = 300, True, [2], a.bv[:1], a.warps[:1]
        PREFILL_DTYPE = torch.float16
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
        prefill_sweep(a.old, a.json)


if __name__ == "__main__":
    main()
