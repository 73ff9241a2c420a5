"""The skinny GEMV's tile and K split for a linear's shape (kernels/gemv.py), from the H200 sweeps.

Only the weight's shape and dtype decide: the batch (M rows, at most 16, or 32 with FP8 weights) changed
the best config by ~2 % at most, except the K tile past 16 rows (128 wide, both dtypes).
"""
import functools

import torch
import triton


@functools.cache
def _cuda_sms(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device):
    """The device's SM count; the H200's 132 off CUDA (the interpreter), so tiles match the GPU's."""
    return _cuda_sms(device.index) if device.type == "cuda" else 132


def default_config(M, N, K, num_sms=132, weight_bytes=2, gated=False):
    """(block_n, block_k, num_warps, num_stages, split_k) for x [M, K] @ weight [N, K].T, M <= 16 (32 for FP8);
    gated: N counts gate and up rows, and block_n is the rows of each half a program reads.

    bf16, swept on the H200 (benchmarks/gemv_bench.py): the largest BLOCK_N (16..64) that still gives every
    SM 4 programs, tiles of ~4096 weight elements (BLOCK_K 256 at 16 rows, 128 above), 2 warps, 4 stages
    for the small tile. The same config was best or within ~2% for every M in 1..16 and for K = 4096 and
    14336, so only N matters. A gated program takes the unfused tile split in two (16 and 32 rows a half
    measured the same). Split K only for down's long rows (K = 14336: 30.5 us against 31.3 at M = 1, in
    32-row tiles cut in 4); split, qkv and o_proj are slower or even and gate_up and lm_head slower (H200,
    benchmarks/gemv_bench.py's split_k sweep).

    FP8 (weight-only): each tile converts in registers before the dot, so a program does more work per
    byte and the small-N linears need more programs than their row tiles give. 64-row tiles with 4 warps
    (gate_up 32.1 us against 38.1 at 32 rows a half), K slices doubled while there are at most 3 programs
    an SM: qkv 18.5 -> 12.5 us, o_proj 11.6 -> 9.2, down 30.3 -> 19.2 (M = 1, H200, gemv_bench.py). At
    17-32 rows (ops.SKINNY_MAX_ROWS_FP8) the same splits with 128-wide K tiles are best.
    """
    if weight_bytes == 1:
        grid_n = triton.cdiv(N // 2 if gated else N, 64)
        split_k = 1
        while split_k < 8 and grid_n * split_k * 2 <= 3 * num_sms:
            split_k *= 2
        return 64, 256 if M <= 16 else 128, 4, 3, split_k
    if K >= 3 * N:  # down_proj
        return 32, 128, 2, 3, 4
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < 4 * num_sms:
        block_n //= 2
    # past 16 rows (M_PAD 32) the x tile doubles: 128-wide K tiles keep a program's registers as at 16 rows
    config = block_n, 128 if M > 16 else max(128, 4096 // block_n), 2, 4 if block_n == 16 else 3, 1
    return (max(16, block_n // 2),) + config[1:] if gated else config
