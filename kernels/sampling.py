"""Sampled token choice without sorting the vocabulary: temperature, top-k, top-p, min-p and a seeded draw per row.

One program per row. Thresholds are found by a 16-way search over the row's values in their ordered-integer
form (every pass counts, or sums the probability mass, above 16 pivots at once: at most 8 passes for 32 bits),
as FlashInfer's sorting-free samplers do, so a 128k-entry row is read a few times instead of sorted. Rows
that only scale by a temperature read their row once. The draw is the exponential race argmax p_i / E_i
written as Gumbel-max (argmax x_i - log E_i), its uniform variates a counter-based hash of (seed, output
position, token id): a row's draw depends on nothing else in the batch, and reference.sample draws the same.

Semantics (reference.sample is the definition): x = logits * inv_temperature (fp32); top-k keeps x >= the
k-th largest x (all ties at the threshold stay); top-p keeps, among those, every token whose strictly larger
survivors hold less than top_p of the survivors' mass (the smallest set reaching top_p, ties at its edge
kept, the top token always); min-p keeps x - max(x) >= log(min_p). Rows with inv_temperature 0 (greedy) are
left as they are in `out`. Not for use inside a CUDA graph capture (outside the graphs for now).
"""
import torch
import triton
import triton.language as tl

from .reference import SAMPLE_FIELDS  # the row record's layout, shared with reference.sample

PIVOTS = 16  # per search pass: 16 pivots cut the interval 17-fold, so 32-bit keys need at most 8 passes
INT32_MIN = tl.constexpr(-(2**31))


@triton.jit
def _fmix32(h):
    """MurmurHash3's finaliser on uint32: a bijection whose every output bit depends on every input bit."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _uniform(tokens, k1, k2):
    """U(0, 1) per token id (uint32) for the row keys k1, k2: 24 random bits, centred, so never 0 or 1."""
    h = _fmix32(_fmix32(tokens + k1) ^ k2)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


@triton.jit
def _key(x):
    """fp32 -> int32 ordered like the values (-0 taken as +0), so a value threshold is an integer search."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _scaled(base, offs, valid, inv_t):
    return tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _sample_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, out_ptr, V,
                   BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NP: tl.constexpr):
    row = tl.program_id(0)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params  # fields at reference.INV_TEMPERATURE ... POSITION (0 ... 6)
    inv_t = tl.load(p_f + 0)
    if inv_t > 0.0:
        top_k = tl.load(p_i + 1)
        top_p = tl.load(p_f + 2)
        log_min_p = tl.load(p_f + 3)
        seed_lo = tl.load(p_i + 4).to(tl.uint32, bitcast=True)
        seed_hi = tl.load(p_i + 5).to(tl.uint32, bitcast=True)
        position = tl.load(p_i + 6).to(tl.uint32, bitcast=True)
        base = logits_ptr + row.to(tl.int64) * stride_row
        has_k = (top_k > 0) & (top_k < V)
        has_p = top_p < 1.0
        has_m = log_min_p > float("-inf")
        m = tl.full([], float("-inf"), tl.float32)  # the row's max, when a filter needs it
        thr = tl.full([], INT32_MIN, tl.int64)  # keep keys >= thr
        if has_k | has_p | has_m:
            mvec = tl.full([BLOCK], float("-inf"), tl.float32)
            for k0 in range(0, V, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                mvec = tl.maximum(mvec, _scaled(base, offs, offs < V, inv_t))
            m = tl.max(mvec, axis=0)
        key_m = _key(m).to(tl.int64)
        j = tl.arange(0, NP).to(tl.int64) + 1
        if has_k:
            # the largest t with count(key >= t) >= k is the k-th largest value's key
            lo = thr
            hi = key_m + 1
            while hi - lo > 1:
                piv = (lo + ((hi - lo) * j) // (NP + 1)).to(tl.int32)
                cnt = tl.zeros([NP], tl.int32)
                for k0 in range(0, V, SEARCH_BLOCK):
                    offs = k0 + tl.arange(0, SEARCH_BLOCK)
                    valid = offs < V
                    key = _key(_scaled(base, offs, valid, inv_t))
                    hit = (key[:, None] >= piv[None, :]) & valid[:, None]
                    cnt += tl.sum(hit.to(tl.int32), axis=0)
                ok = cnt >= top_k
                lo = tl.max(tl.where(ok, piv.to(tl.int64), lo), axis=0)
                hi = tl.min(tl.where(ok, hi, piv.to(tl.int64)), axis=0)
            thr = lo
        if has_p:
            zvec = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, V, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                valid = offs < V
                x = _scaled(base, offs, valid, inv_t)
                zvec += tl.where(valid & (_key(x) >= thr), tl.exp(x - m), 0.0)
            target = top_p * tl.sum(zvec, axis=0)
            # the smallest t whose survivors above t hold less than top_p of the mass
            lo = thr - 1
            hi = key_m
            while hi - lo > 1:
                piv = tl.maximum(lo + ((hi - lo) * j) // (NP + 1), INT32_MIN).to(tl.int32)
                mass = tl.zeros([NP], tl.float32)
                for k0 in range(0, V, SEARCH_BLOCK):
                    offs = k0 + tl.arange(0, SEARCH_BLOCK)
                    valid = offs < V
                    x = _scaled(base, offs, valid, inv_t)
                    key = _key(x)
                    e = tl.where(valid & (key >= thr), tl.exp(x - m), 0.0)
                    mass += tl.sum(tl.where(key[:, None] > piv[None, :], e[:, None], 0.0), axis=0)
                ok = mass < target
                hi = tl.min(tl.where(ok, piv.to(tl.int64), hi), axis=0)
                lo = tl.max(tl.where(ok, lo, piv.to(tl.int64)), axis=0)
            thr = hi
        a = _fmix32(position * 0x9E3779B9 + 0x632BE5AB)
        a = _fmix32(a ^ seed_hi)
        k1 = _fmix32(a ^ seed_lo)
        k2 = _fmix32(k1 + 0x7F4A7C15)
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.full([], 0, tl.int32)
        for k0 in range(0, V, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            valid = offs < V
            x = _scaled(base, offs, valid, inv_t)
            keep = valid & (_key(x) >= thr) & (x - m >= log_min_p)  # log_min_p -inf: off
            u = _uniform(offs.to(tl.uint32), k1, k2)
            score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
            val, i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            if val > best_val:  # strictly greater: an earlier block keeps a tie
                best_val = val
                best_idx = k0 + i
        tl.store(out_ptr + row, best_idx.to(tl.int64))


def sample(logits: torch.Tensor, params: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024,
           search_block: int = 256) -> torch.Tensor:
    """logits [R, V] (last dim contiguous, any float dtype), params int32 [R, >= SAMPLE_FIELDS] (row records, the
    row stride a multiple of 4 so every row is 16-byte aligned) -> int64 [R]: a drawn token for every row with
    inv_temperature > 0; the other rows of `out` are left as they are (uninitialised without `out`)."""
    R, V = logits.shape
    assert logits.stride(-1) == 1 and params.dtype == torch.int32 and params.shape[1] >= SAMPLE_FIELDS
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    # no FMA contraction: x * inv_t and x - max round as in the reference, so thresholds and ties agree
    _sample_kernel[(R,)](logits, logits.stride(0), params, params.view(torch.float32), params.stride(0), out, V,
                         BLOCK=block, SEARCH_BLOCK=search_block, NP=PIVOTS, num_warps=8, enable_fp_fusion=False)
    return out
