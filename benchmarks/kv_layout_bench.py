"""The KV cache's layout inside a block, measured: token-major [block, slot, kv head, dim] against
head-major [block, kv head, slot, dim], on a cache as large as the engine's.

In the token-major layout a decode program (one sequence, one KV head) reads 16 rows of 256 bytes at a
2 KiB stride from each block; head-major, it reads one contiguous 4 KiB run. The kernels take strides, so
both are the same code over a different view of one allocation.

Per layout (taking turns, so drift falls on both), on a cache of --cache-gb over 32 layers:
  decode   paged decode attention with its RoPE and cache write, as the engine launches it, at each batch
           size and context, over 32 layers in one CUDA graph, on block tables drawn at random from the
           whole cache (as after hours of serving) and, token-major, on consecutive blocks (a fresh engine)
  prefill  a 2,048-token chunk after a 2,048-token cached prefix, over 32 layers
  sweep    (head-major) splits, key tile and stages at batch 8 / 16 / 32, context 640 and 1k
Each cell: µs per layer, the median of the turns; the floor is the K/V bytes over the copy bandwidth.

  python3 benchmarks/kv_layout_bench.py OUT_DIR [--cache-gb 80] [--turns 2] [--no-sweep]
Writes OUT_DIR/kv_layout_bench.json and prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_profile import time_graph  # noqa: E402
from gpu_bench import copy_bandwidth  # noqa: E402

from pagefleet.kernels.attention import paged_decode_attention  # noqa: E402
from pagefleet.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

LAYERS, H, HKV, D, BS = 32, 32, 8, 128, 16  # Llama-3.1-8B
SHAPES = [(b, ctx) for ctx in (640, 1024, 4096) for b in (1, 4, 8, 16, 32, 64, 128, 256)]
SWEEP_SHAPES = [(8, 640), (16, 640), (32, 640), (16, 1024)]


def cache(layout: str, num_blocks: int) -> torch.Tensor:
    """[2, layers, blocks, slot, kv head, dim] (a view: head-major is stored [.., kv head, slot, dim])."""
    if layout == "token":
        return torch.zeros(2, LAYERS, num_blocks, BS, HKV, D, dtype=torch.bfloat16, device="cuda")
    return torch.zeros(2, LAYERS, num_blocks, HKV, BS, D, dtype=torch.bfloat16, device="cuda").transpose(3, 4)


def decode_layers(data, tables, ctx, **cfg):
    """fn: one decode step's attention over every layer, with RoPE and the new token's cache write."""
    b = tables.shape[0]
    q = torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(b, HKV, D, dtype=torch.bfloat16, device="cuda"), torch.randn(b, HKV, D, dtype=torch.bfloat16, device="cuda")
    positions = torch.full((b,), ctx - 1, dtype=torch.long, device="cuda")
    cos_sin = torch.randn(ctx, D, dtype=torch.float32, device="cuda")
    slots = (tables[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def fn():
        for layer in range(LAYERS):
            paged_decode_attention(q, data[0, layer], data[1, layer], tables, seq_lens, out=out,
                                   new_kv=(k, v, positions, cos_sin, slots), **cfg)
    return fn


def prefill_layers(data, table, prefix, chunk):
    q = torch.randn(chunk, H, D, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor([prefix + chunk], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def fn():
        for layer in range(LAYERS):
            paged_prefill_attention(q, data[0, layer], data[1, layer], table, seq_lens, cu, out=out)
    return fn


def block_tables(num_blocks: int, b: int, ctx: int, gen: torch.Generator | None) -> torch.Tensor:
    """[b, width] int32, width rounded up to 4 as the engine's: random blocks of the whole cache, or
    (gen None) consecutive ones from block 0."""
    nb = -(-ctx // BS)
    width = -(-nb // 4) * 4
    ids = (torch.randperm(num_blocks, generator=gen)[: b * nb] if gen is not None else torch.arange(b * nb))
    t = torch.zeros(b, width, dtype=torch.int32)
    t[:, :nb] = ids.view(b, nb).int()
    return t.cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--cache-gb", type=float, default=80.0)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    bw = copy_bandwidth()
    block_bytes = 2 * LAYERS * BS * HKV * D * 2
    num_blocks = int(args.cache_gb * 2**30 // block_bytes)
    print(f"copy {bw / 1e12:.2f} TB/s; cache {num_blocks} blocks ({num_blocks * BS} tokens, {args.cache_gb:.0f} GB)", flush=True)
    times: dict[str, list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    tables = {(b, ctx): block_tables(num_blocks, b, ctx, gen) for b, ctx in SHAPES if b * -(-ctx // BS) <= num_blocks}
    prefill_table = block_tables(num_blocks, 1, 4096, gen)
    arms = [("token", "random"), ("token", "consecutive"), ("head", "random")]
    for turn in range(args.turns):
        for layout in ("token", "head"):
            data = cache(layout, num_blocks)
            for tables_kind in [t for lay, t in arms if lay == layout]:
                for (b, ctx), t in tables.items():
                    if tables_kind == "consecutive":
                        t = block_tables(num_blocks, b, ctx, None)
                    key = f"decode {layout} {tables_kind} b={b} ctx={ctx}"
                    times.setdefault(key, []).append(time_graph(decode_layers(data, t, ctx)) / LAYERS)
                print(f"turn {turn} {layout}-major, {tables_kind} blocks: decode done", flush=True)
            key = f"prefill {layout} 2048+2048"
            times.setdefault(key, []).append(time_graph(prefill_layers(data, prefill_table, 2048, 2048)) / LAYERS)
            if layout == "head" and turn == 0 and not args.no_sweep:
                for b, ctx in SWEEP_SHAPES:
                    for splits in (1, 2, 4, 8):
                        for block_n in (64, 128):
                            for stages in (1, 2, 3):
                                cfg = dict(num_splits=splits, block_n=block_n, num_stages=stages)
                                key = f"sweep head b={b} ctx={ctx} " + ",".join(f"{k}={v}" for k, v in cfg.items())
                                times[key] = [time_graph(decode_layers(data, tables[(b, ctx)], ctx, **cfg)) / LAYERS]
                print("head-major sweep done", flush=True)
            del data
            torch.cuda.empty_cache()
    us = {k: statistics.median(v) for k, v in times.items()}
    kv = {(b, ctx): b * ctx * HKV * D * 2 * 2 for b, ctx in tables}
    rows = []
    print("| batch | context | token-major, random blocks | token-major, consecutive | head-major, random | head / token | floor |")
    print("|---|---|---|---|---|---|---|")
    for b, ctx in tables:
        tok, con, head = (us[f"decode {lay} {t} b={b} ctx={ctx}"] for lay, t in arms)
        floor = kv[(b, ctx)] / bw * 1e6
        rows.append({"batch": b, "context": ctx, "token_random_us": tok, "token_consecutive_us": con, "head_random_us": head,
                     "floor_us": floor})
        print(f"| {b} | {ctx} | {tok:.1f} ({100 * floor / tok:.0f} %) | {con:.1f} | {head:.1f} ({100 * floor / head:.0f} %) | "
              f"{head / tok:.3f} | {floor:.1f} |")
    print(f"prefill, 2,048 after 2,048, µs a layer: token-major {us['prefill token 2048+2048']:.1f}, "
          f"head-major {us['prefill head 2048+2048']:.1f}")
    for b, ctx in SWEEP_SHAPES if not args.no_sweep else []:
        sweep = {k.split(f"ctx={ctx} ")[1]: v for k, v in us.items() if k.startswith(f"sweep head b={b} ctx={ctx} ")}
        best = min(sweep, key=sweep.get)
        print(f"sweep head-major b={b} ctx={ctx}: default {us[f'decode head random b={b} ctx={ctx}']:.1f} µs, "
              f"best {sweep[best]:.1f} [{best}]")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "kv_layout_bench.json"), "w") as f:
        json.dump({"copy_bytes_per_s": bw, "num_blocks": num_blocks, "rows": rows, "us": us}, f, indent=1)


if __name__ == "__main__":
    main()
