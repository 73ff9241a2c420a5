"""Decode attention over GRPO's layout: n samples of each prompt side by side, sharing the prompt's blocks.

For each (batch, context) it times one layer's decode attention (Llama-3.1-8B heads, bf16, 16-token blocks) in a CUDA
graph over three block layouts: every row's blocks its own ("distinct"), each group of n rows sharing its first
`--shared` tokens' blocks ("shared"), and the same rows shuffled so that a group's rows are no longer side by side
("scattered"); then the shared layout through kernels/cascade.py, checked against the plain kernel first. "logical
TB/s" counts every row's keys and values as read: where it passes the card's bandwidth, rows share reads through L2.

Usage: python3 benchmarks/cascade_bench.py [--shapes 1024x512 1024x768 512x512 256x768] [--n 16] [--shared 256]
       TRITON_INTERPRET=1 python3 benchmarks/cascade_bench.py --dry-run   (tiny shapes on the CPU, checks only)
"""

from __future__ import annotations

import argparse
import time

import torch

from pagefleet.kernels.attention import paged_decode_attention
from pagefleet.kernels.cascade import cascade_decode_attention, samples_per_program
from pagefleet.worker.executor.step_inputs import shared_prefix_groups

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layout(batch: int, ctx: int, n: int, shared: int, kind: str) -> torch.Tensor:
    """Block tables [batch, blocks a row] for one of the layouts, over a pool of exactly the blocks they use."""
    per_row, prefix = -(-ctx // BLOCK), shared // BLOCK
    if kind == "distinct":
        return torch.randperm(batch * per_row, dtype=torch.int32).view(batch, per_row)
    groups = batch // n
    pool = torch.randperm(groups * prefix + batch * (per_row - prefix), dtype=torch.int32)
    tables = torch.empty(batch, per_row, dtype=torch.int32)
    tables[:, :prefix] = pool[: groups * prefix].view(groups, 1, prefix).expand(groups, n, prefix).reshape(batch, -1)
    tables[:, prefix:] = pool[groups * prefix:].view(batch, per_row - prefix)
    return tables[torch.randperm(batch)] if kind == "scattered" else tables


def time_layer(batch: int, ctx: int, n: int, shared: int, kind: str, cascade: bool, reps: int) -> float:
    """µs of one layer's decode attention, replayed from a graph of 8 launches (the plain launch on CPU)."""
    tables = layout(batch, ctx, n, shared, kind).to(DEV)
    blocks = int(tables.max()) + 1
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16 if DEV == "cuda" else None)
    v = torch.randn_like(k)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=DEV, dtype=k.dtype)
    out = torch.empty_like(q)
    groups, prefix_lens = shared_prefix_groups(tables.cpu().numpy(), lens.cpu().numpy(), BLOCK,
                                               samples_per_program(HEADS, KV_HEADS))
    groups, prefix_lens = torch.from_numpy(groups).to(DEV), torch.from_numpy(prefix_lens).to(DEV)

    def attend() -> None:
        if cascade:
            cascade_decode_attention(q, k, v, tables, lens, groups, prefix_lens, out=out)
        else:
            paged_decode_attention(q, k, v, tables, lens, out=out)

    attend()
    if cascade:  # the same output as the plain kernel, to bf16 rounding
        error = (out.float() - paged_decode_attention(q, k, v, tables, lens).float()).abs().max().item()
        assert error < 2e-2, f"cascade differs from the plain kernel by {error}"
    if DEV != "cuda":
        start = time.perf_counter()
        attend()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            attend()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 8 * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1024x512", "1024x768", "512x512", "256x768"], help="BATCHxCONTEXT")
    p.add_argument("--n", type=int, default=16, help="samples a prompt (rows a group)")
    p.add_argument("--shared", type=int, default=256, help="prompt tokens the samples share (whole blocks)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, each variant checked once (the interpreter)")
    a = p.parse_args()
    shapes = [(64, 40)] if a.dry_run else [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    shared = 32 if a.dry_run else a.shared
    print(torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter: timings mean nothing)")
    print(f"{HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, groups of n = {a.n} sharing {shared} tokens\n")
    print("| batch | context | layout | kernel | µs a layer | logical TB/s |\n|---|---|---|---|---|---|")
    for batch, ctx in shapes:
        for kind, cascade in (("distinct", False), ("shared", False), ("scattered", False), ("shared", True)):
            us = time_layer(batch, ctx, a.n, shared, kind, cascade, a.reps)
            logical = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2  # bf16 keys and values of every row
            print(f"| {batch} | {ctx} | {kind} | {'cascade' if cascade else 'decode'} | {us:,.1f} | "
                  f"{logical / us / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
