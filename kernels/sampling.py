"""Sampled token choice without sorting the vocabulary: temperature, top-k, top-p, min-p and a seeded draw per row.

One program per row, a few passes over its row; small batches can take sampling_split.py's path instead (each row
split across programs, the same tokens; who picks it and when it pays: worker/executor/sampler.py split_pays).
The draw is the exponential race argmax p_i / E_i written as Gumbel-max (argmax x_i - log E_i), its uniform
variates a counter-based hash of (seed, output position, token id): a row's draw depends on nothing else in the
batch, and reference.sample draws the same. Per row, the first pass finds the row's max and, per lane of a
block, the lane's max. Top-k: the k-th largest of those lane maxima is a lower bound on the k-th largest value
(k lanes hold a value at least that large), usually within a few tokens of it; every token at or above such a
bound is gathered into a per-row buffer of CAP (key, token) pairs, and the threshold comes from sorting that
buffer, not the row. Where the bound is too loose (a large k), count passes narrow a bracket [lo, hi) of the
values in their ordered-integer form: each pass counts the keys at or above 16 pivots, 12 spaced in value and 4 in
keys, until the bracket holds at most CAP tokens, which are gathered and sorted; a bracket that cannot shrink is
one value (ties), and is the threshold. Top-p after top-k works on top-k's buffer when it holds every survivor.
Otherwise top-p is drawn by rejection (sampling_split.py's header has the argument): the race over every survivor
gives a candidate and the survivors' mass; the candidate is drawn once the survivors strictly above it hold less
than top_p of that mass, else the race among those above it gives the next; about 1 - top_p of the first
candidates are rejected, so most rows take two passes after the max where the count passes took five or six
and a gather.

Semantics (reference.sample is the definition): x = logits * inv_temperature (fp32); top-k keeps x >= the
k-th largest x (all ties at the threshold stay); top-p keeps, among those, every token whose strictly larger
survivors hold less than top_p of the survivors' mass (the smallest set reaching top_p, ties at its edge
kept, the top token always); min-p keeps x - max(x) >= log(min_p). Rows with inv_temperature 0 (greedy) are
left as they are in `out`. The per-row kernel is not for use inside a CUDA graph capture (outside the graphs for
now); the split path's fixed sequence of launches is.
"""
import torch
import triton
import triton.language as tl

from .reference import SAMPLE_FIELDS  # the row record's layout, shared with reference.sample

PIVOTS = 16  # per count pass: 16 pivots cut a bracket 17-fold
CAP = 2048  # gathered candidates per row: a bracket at most this large is sorted instead of searched further
SMALL = 256  # candidates this few are sorted at this size (top-k 50's usual buffer), not at CAP
INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)
KEY_NEG_INF = tl.constexpr(-2139095041)  # _key(-inf)


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
    """U(0, 1) per token id (uint32) for the row keys k1, k2: 23 random bits, centred, so never 0 or 1 (with 24
    bits the top value, 1 - 2**-25, rounds to 1.0 in fp32: one id in 2**24 per row scored +inf and won)."""
    h = _fmix32(_fmix32(tokens + k1) ^ k2)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _row_noise_keys(p_i):
    """The row keys k1, k2 of _uniform from the row record's seed words and output position (fields 4 ... 6)."""
    seed_lo = tl.load(p_i + 4).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(p_i + 5).to(tl.uint32, bitcast=True)
    position = tl.load(p_i + 6).to(tl.uint32, bitcast=True)
    a = _fmix32(position * 0x9E3779B9 + 0x632BE5AB)
    a = _fmix32(a ^ seed_hi)
    k1 = _fmix32(a ^ seed_lo)
    return k1, _fmix32(k1 + 0x7F4A7C15)


@triton.jit
def _key(x):
    """fp32 -> int32 ordered like the values (-0 taken as +0), so a value threshold is an integer search."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The inverse of _key on int32 keys (INT32_MIN, below every value's key, comes back as a NaN)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, offs, valid, inv_t):
    return tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """NP int64 pivots for the bracket (lo, hi) of keys. NP - 4 are spaced in value: down from hi by 0.25 ...
    44 in steps of 1.6x while lo is -inf or far below, linearly when within 64 (each replaced by an evenly
    spaced key where it falls outside the bracket). The last 4 are spaced in keys, which cuts any bracket
    5-fold per pass (32 bits in at most 14) whatever its values: a threshold at -inf or among values near 0."""
    j = tl.arange(0, NP).to(tl.int64) + 1
    NV: tl.constexpr = NP - 4
    by_key = tl.where(j <= NV, lo + ((hi - lo) * j) // (NP + 1), lo + ((hi - lo) * (j - NV)) // 5)
    hi_v = _value(hi.to(tl.int32))
    lo_v = _value(tl.maximum(lo, KEY_NEG_INF).to(tl.int32))
    span = hi_v - lo_v
    jv = tl.minimum(j, NV).to(tl.float32)
    linear = hi_v - span * jv / (NV + 1)
    geometric = hi_v - 0.25 * tl.exp2((jv - 1.0) * 0.678)
    v = tl.where((lo > KEY_NEG_INF) & (span <= 64.0), linear, geometric)
    by_val = _key(v).to(tl.int64)
    return tl.where((j <= NV) & (by_val > lo) & (by_val < hi), by_val, by_key)


@triton.jit
def _count_pass(base, V, inv_t, piv, SEARCH_BLOCK: tl.constexpr, NP: tl.constexpr, FOLD: tl.constexpr):
    """One pass over the row: per pivot the count of keys >= it."""
    # Per-lane partials in registers, reduced across lanes once after the pass (a reduction per block costs
    # more than the block's arithmetic). One program walks the whole row, so each step's load waits on the
    # memory: FOLD > 1 reads FOLD x SEARCH_BLOCK logits a step and folds them into the same partials, the
    # loop FOLD times shorter for the same registers of partials.
    cnt = tl.zeros([SEARCH_BLOCK, NP], tl.int32)
    p32 = piv.to(tl.int32)
    for k0 in range(0, V, SEARCH_BLOCK * FOLD):
        offs = k0 + tl.arange(0, SEARCH_BLOCK * FOLD)
        valid = offs < V
        key = _key(_scaled(base, offs, valid, inv_t))
        if FOLD == 1:
            cnt += ((key[:, None] >= p32[None, :]) & valid[:, None]).to(tl.int32)
        else:
            key3 = tl.reshape(key, [SEARCH_BLOCK, FOLD])
            valid3 = tl.reshape(valid, [SEARCH_BLOCK, FOLD])
            cnt += tl.sum(((key3[:, :, None] >= p32[None, None, :]) & valid3[:, :, None]).to(tl.int32), axis=1)
    return tl.sum(cnt, axis=0)


@triton.jit
def _gather(base, V, inv_t, lo, hi, keys_ptr, ids_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the row: the (key, token) of every token with lo <= key < hi, in token order, into the
    row's buffer (the first CAP of them) -> how many there are (more than CAP: the buffer is incomplete)."""
    tl.debug_barrier()  # the buffer's earlier contents are read by every warp before any overwrites them
    n = tl.full([], 0, tl.int32)
    for k0 in range(0, V, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        valid = offs < V
        key = _key(_scaled(base, offs, valid, inv_t))
        take = (valid & (key >= lo) & (key < hi)).to(tl.int32)
        c = tl.sum(take, axis=0)
        if c > 0:
            pos = n + tl.cumsum(take, axis=0) - 1
            put = (take > 0) & (pos < CAP)
            tl.store(keys_ptr + pos, key, mask=put)
            tl.store(ids_ptr + pos, offs, mask=put)
        n += c
    tl.debug_barrier()  # written by one warp, read by another
    return n


@triton.jit
def _bracket(base, keys_ptr, ids_ptr, V, inv_t, lo, cnt_lo, hi, cnt_hi, goal_k, CAP: tl.constexpr,
             BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NP: tl.constexpr, FOLD: tl.constexpr):
    """Narrow [lo, hi), which holds top-k's threshold (count(key >= lo) >= goal_k > count(key >= hi) = cnt_hi),
    until it is gathered (<= CAP tokens) or is one key. cnt_lo < 0: not known (a gather finds out). ->
    (gathered: the buffer holds the n tokens of [lo, hi), else hi = lo + 1 and lo is the threshold), lo, hi,
    cnt_hi, n."""
    done = tl.full([], False, tl.int1)
    gathered = tl.full([], False, tl.int1)
    n = tl.full([], 0, tl.int32)
    while not done:
        if (cnt_lo < 0) | (cnt_lo - cnt_hi <= CAP):
            n = _gather(base, V, inv_t, lo, hi, keys_ptr, ids_ptr, CAP, BLOCK)
            if n <= CAP:
                gathered = tl.full([], True, tl.int1)
                done = tl.full([], True, tl.int1)
            else:
                cnt_lo = cnt_hi + n
        if not done:
            if hi - lo <= 1:
                done = tl.full([], True, tl.int1)
            else:
                piv = _pivots(lo, hi, NP)
                cnt = _count_pass(base, V, inv_t, piv, SEARCH_BLOCK, NP, FOLD)
                up = cnt >= goal_k
                lo = tl.maximum(lo, tl.max(tl.where(up, piv, lo), axis=0))
                hi = tl.minimum(hi, tl.min(tl.where(up, hi, piv), axis=0))
                cnt_lo = tl.min(tl.where(up, cnt, tl.where(cnt_lo < 0, INT32_MAX, cnt_lo)), axis=0)
                cnt_lo = tl.where(cnt_lo == INT32_MAX, -1, cnt_lo)
                cnt_hi = tl.max(tl.where(up, cnt_hi, cnt), axis=0)
    return gathered, lo, hi, cnt_hi, n


@triton.jit
def _top_p_in_buffer(s, r, n, m, floor, hi, mass_hi, target):
    """The top-p threshold from the buffer's keys sorted descending (s; r the positions, n filled), which hold
    every key >= floor below hi: the smallest key whose strictly larger survivors hold less than target (a tie
    group is judged at its first place, where the mass before it is least), hi if none does."""
    e = tl.where((r < n) & (s >= floor), tl.exp(_value(s) - m), 0.0)
    before = tl.cumsum(e, axis=0) - e
    ok = (r < n) & (s >= floor) & (mass_hi + before < target)
    return tl.minimum(tl.min(tl.where(ok, s, INT32_MAX), axis=0).to(tl.int64), hi)


@triton.jit
def _solve_top_k(keys_ptr, n, m, top_k, cnt_hi, then_p, top_p, top, SIZE: tl.constexpr):
    """Top-k's threshold from the n <= SIZE gathered keys (every key >= lo below the bracket's top, cnt_hi keys
    above it): the (top_k - cnt_hi)-th largest of them; then (then_p: the buffer holds every survivor) top-p's
    among the survivors."""
    r = tl.arange(0, SIZE)
    s = tl.sort(tl.load(keys_ptr + r, mask=r < n, other=INT32_MIN), descending=True)
    thr = tl.sum(tl.where(r == top_k - cnt_hi - 1, s, 0), axis=0).to(tl.int64)
    if then_p:
        z = tl.sum(tl.where((r < n) & (s >= thr), tl.exp(_value(s) - m), 0.0), axis=0)
        thr = _top_p_in_buffer(s, r, n, m, thr, top, 0.0, top_p * z)
    return thr


@triton.jit
def _key_at(base, token, inv_t):
    """The ordered key of one token's scaled logit, rounded as _scaled and _key round the row's."""
    return _key(tl.load(base + token).to(tl.float32) * inv_t)


@triton.jit
def _race_pass(base, start, end, inv_t, m, floor, above, log_min_p, k1, k2, MASS: tl.constexpr,
               BLOCK: tl.constexpr):
    """One pass over tokens [start, end) of a row (the whole row, or a split path's chunk): among the keys >= floor
    (top-k's survivors) and > above (strictly above a top-p candidate), the Gumbel-max winner of those min-p keeps
    (ties to the lowest id) and (MASS) their mass exp(x - m). -> (mass, the winner's score, the winner)."""
    # Per lane a running best, reduced once after the loop: a scalar compare per block keeps the next block's
    # loads from being issued early (temperature alone, bf16 rows of 128,256 on an H100: 133 us at batch 1
    # against 954, 96 against 186 at 64, 156 against 194 at 256; benchmarks/sampling_bench.py --kernel
    # --baseline 3f43362). Strictly greater keeps a lane's earliest tie, and the smallest id among the lanes'
    # maxima wins, so the token is the one the reference draws.
    mass_vec = tl.zeros([BLOCK], tl.float32)
    best_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    idx_vec = tl.full([BLOCK], 0, tl.int32)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        valid = offs < end
        x = _scaled(base, offs, valid, inv_t)
        key = _key(x)
        surv = valid & (key >= floor) & (key > above)
        if MASS:
            mass_vec += tl.where(surv, tl.exp(x - m), 0.0)
        u = _uniform(offs.to(tl.uint32), k1, k2)
        score = tl.where(surv & (x - m >= log_min_p), x - tl.log(-tl.log(u)), float("-inf"))  # -inf: min-p off
        better = score > best_vec
        best_vec = tl.where(better, score, best_vec)
        idx_vec = tl.where(better, offs, idx_vec)
    best = tl.max(best_vec, axis=0)
    return tl.sum(mass_vec, axis=0), best, tl.min(tl.where(best_vec == best, idx_vec, INT32_MAX), axis=0)


@triton.jit
def _race_to_top_p(base, V, inv_t, m, floor, log_min_p, k1, k2, target, cand, cand_key, BLOCK: tl.constexpr):
    """Top-p by rejection over the whole row, from a candidate (the race's winner among all survivors, or a
    later one): it is drawn once the survivors strictly above it hold less than target, else the winner among
    those above it becomes the candidate (sampling_split.py's header says why this draws the reference's
    token). Each rejection raises the candidate strictly, so the loop ends. -> the drawn token."""
    open_ = tl.full([], 1, tl.int32)
    while open_ == 1:
        mass, best, winner = _race_pass(base, 0, V, inv_t, m, floor, cand_key, log_min_p, k1, k2, True, BLOCK)
        keep = (mass < target) | (best == float("-inf"))  # nothing above it survives: it is the top
        cand = tl.where(keep, cand, winner)
        cand_key = tl.where(keep, cand_key, _key_at(base, winner, inv_t))
        open_ = tl.where(keep, 0, 1)
    return cand


@triton.jit
def _draw_buffer(keys_ptr, ids_ptr, n, m, thr, log_min_p, k1, k2, SIZE: tl.constexpr):
    """The draw among the n <= SIZE gathered tokens, which hold every kept one (ties to the lowest token id, as
    the full-row draw)."""
    r = tl.arange(0, SIZE)
    key = tl.load(keys_ptr + r, mask=r < n, other=INT32_MIN)
    tok = tl.load(ids_ptr + r, mask=r < n, other=0)
    x = _value(key)
    keep = (r < n) & (key >= thr) & (x - m >= log_min_p)
    score = tl.where(keep, x - tl.log(-tl.log(_uniform(tok.to(tl.uint32), k1, k2))), float("-inf"))
    best = tl.max(score, axis=0)
    return tl.min(tl.where(keep & (score == best), tok, INT32_MAX), axis=0)


@triton.jit
def _sample_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, out_ptr, V, work_ptr,
                   BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
                   SMALL: tl.constexpr, FOLD: tl.constexpr):
    row = tl.program_id(0)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params  # fields at reference.INV_TEMPERATURE ... POSITION (0 ... 6)
    inv_t = tl.load(p_f + 0)
    if inv_t > 0.0:
        top_k = tl.load(p_i + 1)
        top_p = tl.load(p_f + 2)
        log_min_p = tl.load(p_f + 3)
        base = logits_ptr + row.to(tl.int64) * stride_row
        keys_ptr = work_ptr + row.to(tl.int64) * (2 * CAP)
        ids_ptr = keys_ptr + CAP
        has_k = (top_k > 0) & (top_k < V)
        has_p = top_p < 1.0
        has_m = log_min_p > float("-inf")
        m = tl.full([], float("-inf"), tl.float32)  # the row's max, when a filter needs it
        thr = tl.full([], INT32_MIN, tl.int64)  # keep keys >= thr
        mvec = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane, the lane's max
        if has_k | has_p | has_m:
            for k0 in range(0, V, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                mvec = tl.maximum(mvec, _scaled(base, offs, offs < V, inv_t))
            m = tl.max(mvec, axis=0)
        key_m = _key(m).to(tl.int64)
        top = key_m + 1  # no key reaches it
        n = tl.full([], 0, tl.int32)
        zero_i = tl.full([], 0, tl.int32)
        in_buffer = tl.full([], False, tl.int1)  # the buffer holds every key >= thr
        p_done = tl.full([], False, tl.int1)
        if has_k:
            lo = tl.full([], INT32_MIN, tl.int64)
            cnt_lo = tl.full([], 0, tl.int32) + V
            if top_k <= BLOCK:
                lane = tl.sort(mvec, descending=True)
                kth_lane = tl.sum(tl.where(tl.arange(0, BLOCK) == top_k - 1, lane, 0.0), axis=0)
                lo = _key(kth_lane).to(tl.int64)
                cnt_lo = tl.full([], -1, tl.int32)
            gathered, lo, hi, cnt_hi, n = _bracket(base, keys_ptr, ids_ptr, V, inv_t, lo, cnt_lo, top, zero_i,
                                                   top_k, CAP, BLOCK, SEARCH_BLOCK, NP, FOLD)
            thr = lo
            if gathered:
                in_buffer = hi == top
                p_done = has_p & in_buffer
                if n <= SMALL:
                    thr = _solve_top_k(keys_ptr, n, m, top_k, cnt_hi, p_done, top_p, top, SMALL)
                else:
                    thr = _solve_top_k(keys_ptr, n, m, top_k, cnt_hi, p_done, top_p, top, CAP)
        k1, k2 = _row_noise_keys(p_i)
        no_candidate = tl.full([], INT32_MIN, tl.int32)
        if has_p & (not p_done):
            # top-p by rejection: the race over every survivor gives the first candidate and the survivors' mass
            total, _, cand = _race_pass(base, 0, V, inv_t, m, thr, no_candidate, log_min_p, k1, k2, True, BLOCK)
            best_idx = _race_to_top_p(base, V, inv_t, m, thr, log_min_p, k1, k2, top_p * total, cand,
                                      _key_at(base, cand, inv_t), BLOCK)
        elif in_buffer:
            if n <= SMALL:
                best_idx = _draw_buffer(keys_ptr, ids_ptr, n, m, thr, log_min_p, k1, k2, SMALL)
            else:
                best_idx = _draw_buffer(keys_ptr, ids_ptr, n, m, thr, log_min_p, k1, k2, CAP)
        else:
            _, _, best_idx = _race_pass(base, 0, V, inv_t, m, thr, no_candidate, log_min_p, k1, k2, False, BLOCK)
        tl.store(out_ptr + row, best_idx.to(tl.int64))


def splits(rows: int, split: bool | None = None, split_rows: int | None = None) -> bool:
    """Whether sample() splits each row across programs: as told, else for batches of at most split_rows rows
    (sampling_split.SPLIT_ROWS unless told), which one program per row would leave most of the SMs idle with."""
    from . import sampling_split

    if split is not None:
        return split
    return rows <= (sampling_split.SPLIT_ROWS if split_rows is None else split_rows)


def sample(logits: torch.Tensor, params: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024,
           search_block: int = 256, cap: int = CAP, fold: int = 1, split: bool | None = None,
           split_rows: int | None = None, chunk: int | None = None,
           filters: tuple[bool, bool, bool] = (True, True, True)) -> torch.Tensor:
    """logits [R, V] (last dim contiguous, any float dtype), params int32 [R, >= SAMPLE_FIELDS] (row records, the
    row stride a multiple of 4 so every row is 16-byte aligned) -> int64 [R]: a drawn token for every row with
    inv_temperature > 0; the other rows of `out` are left as they are (uninitialised without `out`). block and
    cap: powers of two (cap: the candidates gathered per row); fold: logits a count pass reads a step, in
    search_blocks (a power of two). split: the row split across programs of `chunk` logits (sampling_split.py;
    the same tokens), True or False to force either path, None to split batches of at most split_rows rows
    (sampling_split.SPLIT_ROWS unless told). filters: whether any row may use top-k, top-p, min-p; the split path
    leaves out the launches of a filter ruled out (sampling_split.py says what a row then loses), the per-row
    kernel reads every row's."""
    from . import sampling_split  # imports this module's helpers: imported once this module has run

    R, V = logits.shape
    assert logits.stride(-1) == 1 and params.dtype == torch.int32 and params.shape[1] >= SAMPLE_FIELDS
    assert fold >= 1 and fold & (fold - 1) == 0, fold
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    if splits(R, split, split_rows):
        top_k, top_p, min_p = filters
        return sampling_split.sample_split(logits, params, out, sampling_split.CHUNK if chunk is None else chunk,
                                           top_k=top_k, top_p=top_p, min_p=min_p)
    work = torch.empty((R, 2, cap), dtype=torch.int32, device=logits.device)
    # no FMA contraction: x * inv_t and x - max round as in the reference, so thresholds and ties agree
    _sample_kernel[(R,)](logits, logits.stride(0), params, params.view(torch.float32), params.stride(0), out, V,
                         work, BLOCK=block, SEARCH_BLOCK=search_block, NP=PIVOTS, CAP=cap, SMALL=min(SMALL, cap),
                         FOLD=fold, num_warps=8,
                         enable_fp_fusion=False)
    return out
