"""kernels/sampling.py's draw split across R * ceil(V / CHUNK) programs, for batches too few to fill the GPU per row.

The same semantics and the same draw as the per-row kernel (reference.sample is the definition), in a fixed
sequence of launches with no host sync and no data-dependent host loop, so the whole draw can be captured in a
CUDA graph:
  1. per chunk, its max; per row, the max (only where top-p or min-p needs it);
  2. top-k (rows with 0 < top_k < V): a radix select on the ordered-integer keys (sampling._key, as uint32 with
     the sign bit flipped), DIGITS passes of BITS bits from the top: each pass writes, per chunk, a histogram of
     the digit of every key matching the prefix found so far, and a per-row program sums the chunks in chunk
     order and takes the largest digit whose keys at or above it, with those above the prefix, reach top_k:
     after the last pass the prefix is the k-th largest key;
  3. the race: per chunk, the Gumbel-max winner among the survivors of top-k and min-p (the same counter-based
     noise, ties to the lowest token id) and, for top-p rows, the survivors' mass exp(x - max); per row, the
     best chunk winner is the candidate and top_p of the mass the target;
  4. top-p by rejection: the kept set of top-p, and of min-p, is every survivor at or above some value, so the
     race's winner among all survivors is the winner among the kept ones whenever it is kept itself, and it is
     kept when the survivors strictly above it hold less than the target. Each round sums that mass per chunk
     and, in the same read, races the survivors strictly above the candidate; a rejected candidate (nothing at
     or below it is kept) gives way to that race's winner. A candidate is drawn from the survivors' own
     distribution, so it is rejected with probability about 1 - top_p (0.05 at 0.95), and ROUNDS rounds settle
     nearly every row; a row still open after them finishes in one program that repeats the round over its
     whole row until its candidate is kept (each round raises the candidate strictly, so it ends).
Chunk sums go to buffers, never through float atomics, and are summed in a fixed order: a seeded draw is the
same run to run. The mass sums round in another order than the reference's or the per-row kernel's, so a row
whose top-p edge lies within fp32 rounding of a token's mass may keep one token more or less; counts and the
draw are exact. A program whose row does not need its pass (no top-k, no top-p, settled) does nothing; greedy
rows (inv_temperature 0) are left as they are in `out`. The caller may say which filters no row uses
(`top_k`, `top_p`, `min_p` False): their launches are then left out, and a row's top-k or top-p so ruled out is
ignored, as is its min-p when neither top-p nor min-p is named (the row's max is not taken).
Each combination is its own set of compiled kernels (the sampler uses three: worker/executor/sampler.py).
"""
import torch
import triton
import triton.language as tl

from .reference import SAMPLE_FIELDS
from .sampling import INT32_MAX, INT32_MIN, _key, _key_at, _race_pass, _race_to_top_p, _row_noise_keys, _scaled

BITS = 8  # digit width: a 2**BITS-bin histogram a pass
DIGITS = 4  # 32-bit keys in 4 passes
CHUNK = 1024  # logits per program: V = 128,256 is 126 programs a row, about one per SM of an H200 at batch 1
ROUNDS = 3  # top-p rejection rounds split across chunks before a row's own program finishes it
FINISH_BLOCK = 1024  # logits a step of the finishing program
# sample(split=None) takes this path for batches up to this many rows: one program per row leaves most SMs idle
# there. The engine's sampler picks per batch from the rows' settings (worker/executor/sampler.py split_pays);
# this is the default for callers that do not.
SPLIT_ROWS = 16
# State per row, int32 (fp32 fields as bit patterns): the max, top-k's prefix (ordered uint32 bits) and count
# of keys above it, top-p's target mass, the candidate token, its key, whether the row is settled.
ST_MAX, ST_K_PREFIX, ST_K_ABOVE, ST_TARGET, ST_CAND, ST_CAND_KEY, ST_DONE = (tl.constexpr(i) for i in range(7))
STATE_FIELDS = tl.constexpr(8)


@triton.jit
def _ordered(key):
    """int32 ordered key -> uint32 of the same order (sign bit flipped), so digits from the top are radix order."""
    return (key ^ INT32_MIN).to(tl.uint32, bitcast=True)


@triton.jit
def _row_filters(p_i, p_f, V, HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    """A row's inverse temperature, whether its top-k and top-p are on (not if the caller ruled them out), its
    top_p and log_min_p (min-p is off where the max is not taken: x - (-inf) is never below it)."""
    inv_t = tl.load(p_f + 0)
    has_k = tl.full([], False, tl.int1)
    if HAS_K:
        top_k = tl.load(p_i + 1)
        has_k = (top_k > 0) & (top_k < V)
    top_p = tl.full([], 1.0, tl.float32)
    if HAS_P:
        top_p = tl.load(p_f + 2)
    log_min_p = tl.load(p_f + 3)
    return inv_t, has_k, top_p, top_p < 1.0, log_min_p


@triton.jit
def _hist_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, cmax_ptr, hist_ptr,
                 n_chunks, CHUNK: tl.constexpr, NB: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr,
                 FIRST: tl.constexpr, WITH_MAX: tl.constexpr, HAS_K: tl.constexpr):
    """One chunk of one row: (WITH_MAX) its max; (HAS_K) the count histogram of one digit (bits SHIFT .. SHIFT +
    BITS) of its keys matching the row's top-k prefix (FIRST: every key)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params
    inv_t, has_k, _, _, _ = _row_filters(p_i, p_f, V, HAS_K, False)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    if WITH_MAX:
        if inv_t > 0.0:
            tl.store(cmax_ptr + row * n_chunks + c, tl.max(_scaled(base, offs, valid, inv_t), axis=0))
    if HAS_K:
        if (inv_t > 0.0) & has_k:
            key = _key(_scaled(base, offs, valid, inv_t))
            match = valid
            if not FIRST:
                prefix = tl.load(st_ptr + row * STATE_FIELDS + ST_K_PREFIX).to(tl.uint32, bitcast=True)
                match &= (_ordered(key) >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS))
            d = tl.where(match, ((_ordered(key) >> SHIFT) & (NB - 1)).to(tl.int32), 0)
            out = hist_ptr + (row * n_chunks + c).to(tl.int64) * NB + tl.arange(0, NB)
            tl.store(out, tl.histogram(d, NB, mask=match))


@triton.jit
def _select_kernel(params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, cmax_ptr, hist_ptr, n_chunks,
                   NB: tl.constexpr, SHIFT: tl.constexpr, FIRST: tl.constexpr, WITH_MAX: tl.constexpr,
                   HAS_K: tl.constexpr, CBLOCK: tl.constexpr, CTILE: tl.constexpr):
    """One row: (WITH_MAX) the max of its chunk maxima; (HAS_K) the pass's digit from the chunks' histograms,
    summed in chunk order (CTILE chunks a step), appended to the row's top-k prefix."""
    row = tl.program_id(0)
    p_i = params_ptr + row * stride_params
    p_f = paramsf_ptr + row * stride_params
    inv_t, has_k, _, _, _ = _row_filters(p_i, p_f, V, HAS_K, False)
    top_k = tl.load(p_i + 1)
    st = st_ptr + row * STATE_FIELDS
    if WITH_MAX:
        if inv_t > 0.0:
            cs = tl.arange(0, CBLOCK)
            tl.store(stf_ptr + row * STATE_FIELDS + ST_MAX,
                     tl.max(tl.load(cmax_ptr + row * n_chunks + cs, mask=cs < n_chunks, other=float("-inf")),
                            axis=0))
    if HAS_K:
        if (inv_t > 0.0) & has_k:
            j = tl.arange(0, NB)  # place j holds digit NB - 1 - j: a running sum over j is the count at or above
            ct = tl.arange(0, CTILE)
            h = tl.zeros([NB], tl.int32)
            for c0 in range(0, n_chunks, CTILE):
                cc = c0 + ct
                tile = tl.load(hist_ptr + (row * n_chunks + cc[:, None]).to(tl.int64) * NB + (NB - 1 - j)[None, :],
                               mask=(cc < n_chunks)[:, None], other=0)
                h += tl.sum(tile, axis=0)
            if FIRST:
                above = tl.full([], 0, tl.int32)
                prefix = tl.full([], 0, tl.int32)
            else:
                above = tl.load(st + ST_K_ABOVE)
                prefix = tl.load(st + ST_K_PREFIX)
            pick = tl.min(tl.where(above + tl.cumsum(h, axis=0) >= top_k, j, NB), axis=0)
            tl.store(st + ST_K_ABOVE, above + tl.sum(tl.where(j < pick, h, 0), axis=0))
            tl.store(st + ST_K_PREFIX, prefix | ((NB - 1 - pick) << SHIFT))


@triton.jit
def _floor(st, has_k):
    """The least key that survives the row's top-k (its threshold once the radix select is done)."""
    floor = tl.full([], INT32_MIN, tl.int32)
    if has_k:
        floor = tl.load(st + ST_K_PREFIX) ^ INT32_MIN
    return floor


@triton.jit
def _race_row(params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, FIRST: tl.constexpr, HAS_K: tl.constexpr,
              HAS_P: tl.constexpr):
    """This program's row in a race: its record, filters and state, and whether it races (a sampled row; after
    the first race, one not settled yet)."""
    row = tl.program_id(0)
    p_i = params_ptr + row * stride_params
    inv_t, has_k, top_p, has_p, log_min_p = _row_filters(p_i, paramsf_ptr + row * stride_params, V, HAS_K, HAS_P)
    st = st_ptr + row * STATE_FIELDS
    live = inv_t > 0.0
    if not FIRST:
        live &= tl.load(st + ST_DONE) == 0
    return row, p_i, inv_t, has_k, top_p, has_p, log_min_p, st, stf_ptr + row * STATE_FIELDS, live


@triton.jit
def _race_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, val_ptr,
                 idx_ptr, mass_ptr, n_chunks, CHUNK: tl.constexpr, FIRST: tl.constexpr, WITH_MAX: tl.constexpr,
                 HAS_K: tl.constexpr, HAS_P: tl.constexpr):
    """One chunk of one row: the Gumbel-max winner among its survivors of top-k and min-p (FIRST) or among those
    strictly above the row's candidate, and (top-p rows) those survivors' mass."""
    row, p_i, inv_t, has_k, top_p, has_p, log_min_p, st, stf, live = _race_row(
        params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, FIRST, HAS_K, HAS_P)
    c = tl.program_id(1)
    if live:
        m = tl.full([], float("-inf"), tl.float32)  # -inf without min-p or top-p: x - m never below log_min_p
        if WITH_MAX:
            m = tl.load(stf + ST_MAX)
        above = tl.full([], INT32_MIN, tl.int32)  # below every key: no candidate yet
        if not FIRST:
            above = tl.load(st + ST_CAND_KEY)
        k1, k2 = _row_noise_keys(p_i)
        start = c * CHUNK
        mass, val, winner = _race_pass(logits_ptr + row.to(tl.int64) * stride_row, start,
                                       tl.minimum(start + CHUNK, V), inv_t, m, _floor(st, has_k), above, log_min_p,
                                       k1, k2, HAS_P, CHUNK)
        if HAS_P:
            if has_p:
                tl.store(mass_ptr + row * n_chunks + c, mass)
        tl.store(val_ptr + row * n_chunks + c, val)
        tl.store(idx_ptr + row * n_chunks + c, winner)


@triton.jit
def _settle(logits_ptr, stride_row, inv_t, st, cand, keep, out_ptr, row):
    """Draw the candidate (keep), or record it as the row's new candidate with its key."""
    if keep:
        tl.store(out_ptr + row, cand.to(tl.int64))
        tl.store(st + ST_DONE, 1)
    else:
        tl.store(st + ST_CAND, cand)
        tl.store(st + ST_CAND_KEY, _key_at(logits_ptr + row.to(tl.int64) * stride_row, cand, inv_t))
        tl.store(st + ST_DONE, 0)


@triton.jit
def _race_select_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr,
                        val_ptr, idx_ptr, mass_ptr, out_ptr, n_chunks, FIRST: tl.constexpr, HAS_K: tl.constexpr,
                        HAS_P: tl.constexpr, CBLOCK: tl.constexpr):
    """One row: the best chunk winner (ties to the lowest chunk, so the lowest token id) and the mass summed in
    chunk order. FIRST: the winner is drawn, or for a top-p row becomes the candidate and top_p of the mass the
    target. Later: the candidate is drawn if the mass above it is below the target, else the winner above it
    becomes the candidate."""
    row, p_i, inv_t, has_k, top_p, has_p, log_min_p, st, stf, live = _race_row(
        params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, FIRST, HAS_K, HAS_P)
    if live:
        cs = tl.arange(0, CBLOCK)
        in_row = cs < n_chunks
        val = tl.load(val_ptr + row * n_chunks + cs, mask=in_row, other=float("-inf"))
        idx = tl.load(idx_ptr + row * n_chunks + cs, mask=in_row, other=INT32_MAX)
        best = tl.max(val, axis=0)
        winner = tl.min(tl.where(in_row & (val == best), idx, INT32_MAX), axis=0)
        mass = tl.full([], 0.0, tl.float32)
        if HAS_P:
            if has_p:
                mass = tl.sum(tl.load(mass_ptr + row * n_chunks + cs, mask=in_row, other=0.0), axis=0)
        if FIRST:
            if has_p:
                tl.store(stf + ST_TARGET, top_p * mass)
            _settle(logits_ptr, stride_row, inv_t, st, winner, has_p == 0, out_ptr, row)
        else:
            # kept: the survivors strictly above hold less than the target, or nothing survives above it
            keep = (mass < tl.load(stf + ST_TARGET)) | (best == float("-inf"))
            _settle(logits_ptr, stride_row, inv_t, st, tl.where(keep, tl.load(st + ST_CAND), winner), keep,
                    out_ptr, row)


@triton.jit
def _race_finish_kernel(logits_ptr, stride_row, params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr,
                        out_ptr, BLOCK: tl.constexpr, HAS_K: tl.constexpr):
    """One row still open after the split rounds: the per-row kernel's rounds over its whole row, until its
    candidate is kept."""
    row, p_i, inv_t, has_k, top_p, has_p, log_min_p, st, stf, live = _race_row(
        params_ptr, paramsf_ptr, stride_params, V, st_ptr, stf_ptr, False, HAS_K, True)
    if live:
        k1, k2 = _row_noise_keys(p_i)
        token = _race_to_top_p(logits_ptr + row.to(tl.int64) * stride_row, V, inv_t, tl.load(stf + ST_MAX),
                               _floor(st, has_k), log_min_p, k1, k2, tl.load(stf + ST_TARGET),
                               tl.load(st + ST_CAND), tl.load(st + ST_CAND_KEY), BLOCK)
        tl.store(out_ptr + row, token.to(tl.int64))


def sample_split(logits: torch.Tensor, params: torch.Tensor, out: torch.Tensor, chunk: int = CHUNK,
                 top_k: bool = True, top_p: bool = True, min_p: bool = True, rounds: int = ROUNDS) -> torch.Tensor:
    """sampling.sample's draw over R * ceil(V / chunk) programs (chunk a power of two, at least 16): the same
    arguments, the same tokens (but at a top-p edge within fp32 rounding). top_k, top_p, min_p: whether any row
    may use that filter (False leaves its launches out: 2 launches for temperature alone, 5 + 2 * rounds for
    top-p, 8 more for top-k)."""
    R, V = logits.shape
    assert chunk >= 16 and chunk & (chunk - 1) == 0, chunk
    n_chunks = triton.cdiv(V, chunk)
    nb = 1 << BITS
    # one workspace, cut into 16-byte aligned pieces (Triton compiles a variant per pointer alignment): one
    # allocation a draw instead of six
    shapes = [(R, STATE_FIELDS.value), (R, n_chunks), (R, n_chunks, nb) if top_k else (1,), (R, n_chunks),
              (R, n_chunks), (R, n_chunks)]
    sizes = [-(-torch.Size(s).numel() // 4) * 4 for s in shapes]
    work = torch.empty(sum(sizes), dtype=torch.int32, device=logits.device)
    pieces, at = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        pieces.append(work[at: at + torch.Size(shape).numel()].view(shape))
        at += size
    state, cmax, hist, win_val, win_idx, mass = pieces
    statef, cmax, win_val, mass = (t.view(torch.float32) for t in (state, cmax, win_val, mass))
    paramsf = params.view(torch.float32)
    cblock = triton.next_power_of_2(n_chunks)
    rows, grid = (R,), (R, n_chunks)
    # no FMA contraction: x * inv_t and x - max round as in the reference, so thresholds and ties agree
    opts = dict(num_warps=4, enable_fp_fusion=False)
    with_max = top_p or min_p
    for p in range(DIGITS if top_k else 1 if with_max else 0):
        shift = BITS * (DIGITS - 1 - p)
        first = p == 0  # the max pass and top-k's first histogram read the chunk once
        _hist_kernel[grid](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, cmax, hist,
                           n_chunks, CHUNK=chunk, NB=nb, SHIFT=shift, BITS=BITS, FIRST=first,
                           WITH_MAX=first and with_max, HAS_K=top_k, **opts)
        _select_kernel[rows](params, paramsf, params.stride(0), V, state, statef, cmax, hist, n_chunks, NB=nb,
                             SHIFT=shift, FIRST=first, WITH_MAX=first and with_max, HAS_K=top_k, CBLOCK=cblock,
                             CTILE=min(16, cblock), **opts)
    flags = dict(HAS_K=top_k, HAS_P=top_p)
    for r in range(1 + rounds if top_p else 1):
        _race_kernel[grid](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, statef, win_val,
                           win_idx, mass, n_chunks, CHUNK=chunk, FIRST=r == 0, WITH_MAX=with_max, **flags,
                           **opts)
        _race_select_kernel[rows](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, statef,
                                  win_val, win_idx, mass, out, n_chunks, FIRST=r == 0, CBLOCK=cblock, **flags,
                                  **opts)
    if top_p:
        _race_finish_kernel[rows](logits, logits.stride(0), params, paramsf, params.stride(0), V, state, statef,
                                  out, BLOCK=min(FINISH_BLOCK, triton.next_power_of_2(V)), HAS_K=top_k, **opts)
    return out


assert SAMPLE_FIELDS >= 7  # the row record's fields 0 ... 6 (reference.INV_TEMPERATURE ... POSITION) are read
