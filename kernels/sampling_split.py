"""kernels/sampling.py's draw split across R * ceil(V / CHUNK) programs, for batches too few to fill the GPU per row.

The same semantics and the same draw as the per-row kernel (reference.sample is the definition), in a fixed
sequence of launches with no host sync and no data-dependent host loop, so the whole draw can be captured in a
CUDA graph:
  1. per chunk, its max (and, for top-k rows, the first digit's count histogram); per row, the max;
  2. top-k (rows with 0 < top_k < V): a radix select on the ordered-integer keys (sampling._key, as uint32 with
     the sign bit flipped), DIGITS passes of BITS bits from the top: each pass writes, per chunk, a histogram of
     the digit of every key matching the prefix found so far, and a per-row program sums the chunks in chunk
     order and takes the largest digit whose keys at or above it, with those above the prefix, reach top_k:
     after the last pass the prefix is the k-th largest key;
  3. top-p (rows with top_p < 1): the same select over the mass exp(x - max) of the keys at or above top-k's
     threshold, for the largest key whose mass at or above it reaches top_p of the survivors' mass (summed by
     the first pass): every token whose strictly larger survivors hold less than that is kept, ties at the edge
     too, the top token always. A chunk's mass histogram is a [16, K] x [K, 16] product of one-hots of the
     digit's two halves, one weighted by the mass, on the tensor cores;
  4. per chunk, the Gumbel-max draw over its kept tokens (the same counter-based noise, min-p applied), ties to
     the lowest token id; per row, the best of the chunk winners, ties to the lowest chunk.
Histograms go to buffers, never through float atomics, and are summed in a fixed order: a seeded draw is the
same run to run. The mass sums round in another order than the reference's or the per-row kernel's, so a row
whose top-p edge lies within fp32 rounding of a token's mass may keep one token more or less; counts and the
draw are exact. A pass a row does not need (no top-k, no top-p) is a launch whose programs for that row do
nothing; greedy rows (inv_temperature 0) are left as they are in `out`.
"""
import torch
import triton
import triton.language as tl

from .reference import SAMPLE_FIELDS
from .sampling import INT32_MIN, _key, _row_noise_keys, _scaled, _uniform

BITS = 8  # digit width: a 2**BITS-bin histogram a pass
DIGITS = 4  # 32-bit keys in 4 passes
CHUNK = 1024  # logits per program: V = 128,256 is 126 programs a row, about one per SM of an H200 at batch 1
SUB = 128  # logits per step of a mass histogram (at most the chunk): the K of its [16, SUB] x [SUB, 16] product
# sample(split=None) takes this path for batches up to this many rows. Launched outside a CUDA graph it pays 18
# launches (~480 us however small the batch), so it wins only where one program per row runs long: top-p alone
# over 128k logits, 1,287 against 489 us at one row, 1,297 against 692 at 16, losing at 64 (H200,
# benchmarks/sampling_bench.py --kernel). The engine's sampler picks per batch from the rows' settings
# (worker/executor/sampler.py split_pays); this is the default for callers that do not.
SPLIT_ROWS = 16
# State per row, int32 (fp32 fields as bit patterns): the max, top-k's prefix (ordered uint32 bits) and count
# of keys above it, top-p's prefix and mass above it, top-p's target mass.
ST_MAX, ST_K_PREFIX, ST_K_ABOVE, ST_P_PREFIX, ST_P_ABOVE, ST_TARGET = (tl.constexpr(i) for i in range(6))
STATE_FIELDS = tl.constexpr(8)


@triton.jit
def _ordered(key):
    """int32 ordered key -> uint32 of the same order (sign bit flipped), so digits from the top are radix order."""
    return (key ^ INT32_MIN).to(tl.uint32, bitcast=True)


@triton.jit
def _matches(key, valid, floor, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    """The keys a pass counts: valid, at or above floor (top-k's threshold, for top-p), and (after the first pass)
    sharing the row's prefix, the digits above bit SHIFT + BITS found so far (of the keys as _ordered)."""
    match = valid & (key >= floor)
    if not FIRST:
        u = _ordered(key)
        match &= (u >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS))
    return match


@triton.jit
def _row_filters(p_i, p_f, V):
    inv_t = tl.load(p_f + 0)
    top_k = tl.load(p_i + 1)
    top_p = tl.load(p_f + 2)
    return inv_t, top_k, top_p, (top_k > 0) & (top_k < V), top_p < 1.0


@triton.jit
def _hist_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, cmax_ptr,
                 hist_ptr, n_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
                 SHIFT: tl.constexpr, FIRST: tl.constexpr, MASS: tl.constexpr, WITH_MAX: tl.constexpr):
    """One chunk of one row: (WITH_MAX) its max; the histogram of one digit (bits SHIFT .. SHIFT + log2 NB) of
    its keys matching the row's prefix (FIRST: every key): counts (top-k) or, MASS, the mass exp(x - max) of the
    keys at or above top-k's threshold (top-p)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params
    inv_t, top_k, top_p, has_k, has_p = _row_filters(p_i, p_f, V)
    base = logits_ptr + row.to(tl.int64) * stride_row
    start = c * CHUNK
    if WITH_MAX:
        if inv_t > 0.0:
            offs = start + tl.arange(0, CHUNK)
            tl.store(cmax_ptr + row * n_chunks + c, tl.max(_scaled(base, offs, offs < V, inv_t), axis=0))
    bins = tl.arange(0, NB)
    out = hist_ptr + (row * n_chunks + c).to(tl.int64) * NB + bins
    if MASS:
        if (inv_t > 0.0) & has_p:
            m = tl.load(stf_ptr + row * STATE_FIELDS + ST_MAX)
            prefix = tl.load(st_ptr + row * STATE_FIELDS + ST_P_PREFIX).to(tl.uint32, bitcast=True)
            floor = tl.full([], INT32_MIN, tl.int32)
            if has_k:
                floor = tl.load(st_ptr + row * STATE_FIELDS + ST_K_PREFIX) ^ INT32_MIN
            # digit = 16 * hi + lo: the mass per (hi, lo) is the product of the [16, SUB] mass-weighted one-hots of
            # hi and the [SUB, 16] one-hots of lo, on the tensor cores (tf32x3: fp32-accurate, the 0/1 factor
            # exact, a fixed summation order), not 256 compares and adds per logit
            NH: tl.constexpr = 1 << (BITS // 2)
            r = tl.arange(0, NH)
            acc = tl.zeros([NH, NH], tl.float32)
            offs = start + tl.arange(0, CHUNK)
            key = _key(_scaled(base, offs, offs < V, inv_t))
            # later passes match few keys: most chunks, and most steps of the rest, skip; the whole-chunk read
            # also brings the chunk into L1 for the steps
            if tl.max(_matches(key, offs < V, floor, prefix, SHIFT, BITS, FIRST).to(tl.int32), axis=0) > 0:
                for s in range(0, CHUNK, SUB):
                    o = start + s + tl.arange(0, SUB)
                    valid = o < V
                    x = _scaled(base, o, valid, inv_t)
                    k = _key(x)
                    match = _matches(k, valid, floor, prefix, SHIFT, BITS, FIRST)
                    if tl.max(match.to(tl.int32), axis=0) > 0:
                        d = ((_ordered(k) >> SHIFT) & (NB - 1)).to(tl.int32)
                        e = tl.where(match, tl.exp(x - m), 0.0)
                        a = tl.where((d >> (BITS // 2))[None, :] == r[:, None], e[None, :], 0.0)
                        b = ((d & (NH - 1))[:, None] == r[None, :]).to(tl.float32)
                        acc = tl.dot(a, b, acc, input_precision="tf32x3")
            tl.store(out, tl.reshape(acc, [NB]))
    else:
        if (inv_t > 0.0) & has_k:
            offs = start + tl.arange(0, CHUNK)
            valid = offs < V
            key = _key(_scaled(base, offs, valid, inv_t))
            prefix = tl.load(st_ptr + row * STATE_FIELDS + ST_K_PREFIX).to(tl.uint32, bitcast=True)
            match = _matches(key, valid, INT32_MIN, prefix, SHIFT, BITS, FIRST)
            d = tl.where(match, ((_ordered(key) >> SHIFT) & (NB - 1)).to(tl.int32), 0)
            tl.store(out, tl.histogram(d, NB, mask=match))


@triton.jit
def _select_kernel(params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, cmax_ptr, hist_ptr, n_chunks,
                   NB: tl.constexpr, SHIFT: tl.constexpr, FIRST: tl.constexpr, MASS: tl.constexpr,
                   WITH_MAX: tl.constexpr, CBLOCK: tl.constexpr, CTILE: tl.constexpr):
    """One row: (WITH_MAX) the max of its chunk maxima; the pass's digit from the chunks' histograms, summed in
    chunk order (CTILE chunks a step), appended to the row's prefix."""
    row = tl.program_id(0)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params
    inv_t, top_k, top_p, has_k, has_p = _row_filters(p_i, p_f, V)
    st = st_ptr + row * STATE_FIELDS
    stf = stf_ptr + row * STATE_FIELDS
    if WITH_MAX:
        if inv_t > 0.0:
            cs = tl.arange(0, CBLOCK)
            tl.store(stf + ST_MAX, tl.max(tl.load(cmax_ptr + row * n_chunks + cs, mask=cs < n_chunks,
                                                  other=float("-inf")), axis=0))
    if MASS:
        active = (inv_t > 0.0) & has_p
    else:
        active = (inv_t > 0.0) & has_k
    if active:
        j = tl.arange(0, NB)  # place j holds digit NB - 1 - j: a running sum over j is the mass at or above
        ct = tl.arange(0, CTILE)
        if MASS:
            h = tl.zeros([NB], tl.float32)
        else:
            h = tl.zeros([NB], tl.int32)
        for c0 in range(0, n_chunks, CTILE):
            cc = c0 + ct
            tile = tl.load(hist_ptr + (row * n_chunks + cc[:, None]).to(tl.int64) * NB + (NB - 1 - j)[None, :],
                           mask=(cc < n_chunks)[:, None], other=0)
            if MASS:
                h += tl.sum(tile.to(tl.float32, bitcast=True), axis=0)
            else:
                h += tl.sum(tile, axis=0)
        at_or_above = tl.cumsum(h, axis=0)
        if MASS:
            if FIRST:
                target = top_p * tl.sum(h, axis=0)
                tl.store(stf + ST_TARGET, target)
                above = tl.full([], 0.0, tl.float32)
                prefix = tl.full([], 0, tl.int32)
            else:
                target = tl.load(stf + ST_TARGET)
                above = tl.load(stf + ST_P_ABOVE)
                prefix = tl.load(st + ST_P_PREFIX)
            ok = above + at_or_above >= target
            present = h > 0.0
        else:
            if FIRST:
                above = tl.full([], 0, tl.int32)
                prefix = tl.full([], 0, tl.int32)
            else:
                above = tl.load(st + ST_K_ABOVE)
                prefix = tl.load(st + ST_K_PREFIX)
            ok = above + at_or_above >= top_k
            present = h > 0
        pick = tl.min(tl.where(ok, j, NB), axis=0)
        # counts reach top_k exactly; a mass re-summed finer can round below the target its coarser bin reached:
        # then the lowest digit holding mass, which keeps the most
        pick = tl.where(pick == NB, tl.max(tl.where(present, j, 0), axis=0), pick)
        above = above + tl.sum(tl.where(j < pick, h, 0), axis=0)
        prefix = prefix | ((NB - 1 - pick) << SHIFT)
        if MASS:
            tl.store(st + ST_P_PREFIX, prefix)
            tl.store(stf + ST_P_ABOVE, above)
        else:
            tl.store(st + ST_K_PREFIX, prefix)
            tl.store(st + ST_K_ABOVE, above)


@triton.jit
def _draw_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, val_ptr,
                 idx_ptr, n_chunks, CHUNK: tl.constexpr):
    """One chunk of one row: the Gumbel-max winner among its kept tokens (ties to the lowest token id)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params
    inv_t, top_k, top_p, has_k, has_p = _row_filters(p_i, p_f, V)
    if inv_t > 0.0:
        log_min_p = tl.load(p_f + 3)
        k1, k2 = _row_noise_keys(p_i)
        thr = tl.full([], INT32_MIN, tl.int32)  # keep keys >= thr
        if has_k:
            thr = tl.load(st_ptr + row * STATE_FIELDS + ST_K_PREFIX) ^ INT32_MIN
        if has_p:
            thr = tl.load(st_ptr + row * STATE_FIELDS + ST_P_PREFIX) ^ INT32_MIN
        m = tl.load(stf_ptr + row * STATE_FIELDS + ST_MAX)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        valid = offs < V
        x = _scaled(logits_ptr + row.to(tl.int64) * stride_row, offs, valid, inv_t)
        keep = valid & (_key(x) >= thr) & (x - m >= log_min_p)  # log_min_p -inf: off
        u = _uniform(offs.to(tl.uint32), k1, k2)
        score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))
        val, i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + row * n_chunks + c, val)
        tl.store(idx_ptr + row * n_chunks + c, c * CHUNK + i)


@triton.jit
def _pick_kernel(paramsf_ptr, stride_params, val_ptr, idx_ptr, out_ptr, n_chunks, CBLOCK: tl.constexpr):
    """One row: the best chunk winner, ties to the lowest chunk (the lowest token id, as the per-row kernel)."""
    row = tl.program_id(0)
    if tl.load(paramsf_ptr + row * stride_params) > 0.0:
        cs = tl.arange(0, CBLOCK)
        live = cs < n_chunks
        val = tl.load(val_ptr + row * n_chunks + cs, mask=live, other=float("-inf"))
        idx = tl.load(idx_ptr + row * n_chunks + cs, mask=live, other=2**31 - 1)
        best = tl.max(val, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(live & (val == best), idx, 2**31 - 1), axis=0).to(tl.int64))


def sample_split(logits: torch.Tensor, params: torch.Tensor, out: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """sampling.sample's draw over R * ceil(V / chunk) programs (chunk a power of two, at least 16): the
    same arguments, the same tokens (but at a top-p edge within fp32 rounding), in 2 + 4 * DIGITS launches."""
    R, V = logits.shape
    assert chunk >= 16 and chunk & (chunk - 1) == 0, chunk
    n_chunks = triton.cdiv(V, chunk)
    dev = logits.device
    nb = 1 << BITS
    state = torch.empty((R, STATE_FIELDS.value), dtype=torch.int32, device=dev)
    statef = state.view(torch.float32)
    cmax = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    hist = torch.empty((R, n_chunks, nb), dtype=torch.int32, device=dev)
    histf = hist.view(torch.float32)
    win_val = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    win_idx = torch.empty((R, n_chunks), dtype=torch.int32, device=dev)
    paramsf = params.view(torch.float32)
    cblock = triton.next_power_of_2(n_chunks)
    ctile = min(16, cblock)
    rows, grid = (R,), (R, n_chunks)
    # no FMA contraction: x * inv_t and x - max round as in the reference, so thresholds and ties agree
    opts = dict(num_warps=4, enable_fp_fusion=False)
    sub = min(SUB, chunk)
    for mass in (False, True):
        h = histf if mass else hist
        for p in range(DIGITS):
            shift = BITS * (DIGITS - 1 - p)
            with_max = not mass and p == 0  # the max pass and top-k's first histogram read the chunk once
            _hist_kernel[grid](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, statef, cmax,
                               h, n_chunks, CHUNK=chunk, SUB=sub, NB=nb, BITS=BITS, SHIFT=shift, FIRST=p == 0,
                               MASS=mass, WITH_MAX=with_max, **opts)
            _select_kernel[rows](params, paramsf, params.stride(0), V, state, statef, cmax, hist, n_chunks, NB=nb,
                                 SHIFT=shift, FIRST=p == 0, MASS=mass, WITH_MAX=with_max, CBLOCK=cblock,
                                 CTILE=ctile, **opts)
    _draw_kernel[grid](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, statef, win_val,
                       win_idx, n_chunks, CHUNK=chunk, **opts)
    _pick_kernel[rows](paramsf, params.stride(0), win_val, win_idx, out, n_chunks, CBLOCK=cblock, **opts)
    return out


assert SAMPLE_FIELDS >= 7  # the row record's fields 0 ... 6 (reference.INV_TEMPERATURE ... POSITION) are read
