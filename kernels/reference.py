"""Plain-torch versions of every kernel in this package.

They are the ground truth the Triton kernels are tested against, and the engine's CPU path,
so they are vectorised over the batch where that is cheap. Over 300 lines: one reference for each kernel,
kept in one module so a kernel's test and the CPU path find every one in the same place.
Layouts (the contract with the engine):
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping      int64 [num_new_tokens], slot = block_id * block_size + offset, -1 = skip
  block_tables      int32 [num_seqs, max_blocks_per_seq], padded with 0 or -1
  seq_lens          int32 [num_seqs], tokens in the cache after this step's write
  cu_seqlens_q      int32 [num_seqs + 1], start of each sequence's queries in the packed q
"""
import math

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------- KV cache


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Scatter this step's k/v [T, Hkv, D] into the paged cache at slot_mapping (in place)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Index assignment on (block, offset) works for non-contiguous caches too; an fp8 cache is written as bytes
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = to_cache_dtype(x[keep], cache.dtype)
        if cache.element_size() == 1:
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache[blocks, offsets] = x


def to_cache_dtype(x, dtype):
    """x in a cache of dtype: an e4m3 cache (scale 1.0) saturates at +-FP8_MAX, where a plain cast gives NaN."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


# ---------------------------------------------------------------- attention


def take_blocks(cache, blocks):
    """cache[blocks]; an fp8 cache is gathered as bytes, which every device's index kernels take."""
    if cache.element_size() == 1:
        return cache.view(torch.uint8)[blocks].view(cache.dtype)
    return cache[blocks]


def gather_kv(cache, block_table, length):
    """Contiguous [length, Hkv, D] view of one sequence's cached keys or values."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return take_blocks(cache, blocks).flatten(0, 1)[:length]


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, max_seq_len=None, out=None,
                           new_kv=None):
    """One query token per sequence: q [B, H, D] -> [B, H, D], batched over all sequences.

    new_kv=(k, v, positions, cos_sin_cache, slot_mapping): q and k are before RoPE; rope_and_write_kv first.
    """
    if new_kv is not None:
        k, v, positions, cos_sin_cache, slot_mapping = new_kv
        q = rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if max_seq_len is None or not seq_lens.is_cuda:  # on the CPU the true max costs nothing and can't be stale
        max_seq_len = int(seq_lens.max()) if B else 0
    num_blocks = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].long().clamp(min=0)  # -1 padding -> any valid block, masked below
    k = take_blocks(k_cache, blocks).flatten(1, 2).float()  # [B, L, Hkv, D]
    v = take_blocks(v_cache, blocks).flatten(1, 2).float()
    qg = q.float().view(B, Hkv, group, D)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale  # [B, Hkv, G, L]
    positions = torch.arange(k.shape[1], device=q.device)
    invalid = positions[None, :] >= seq_lens[:, None].long()  # [B, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    o = torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(B, H, D).to(q.dtype)
    return o if out is None else out.copy_(o)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=None, max_seq_len=None,
                            out=None):
    """Variable-length causal attention over the paged cache: q [T, H, D] packed -> [T, H, D].

    Sequence s owns q rows cu_seqlens_q[s]:cu_seqlens_q[s+1]; they are its last q_len positions,
    so query i sits at absolute position seq_len - q_len + i and sees cache positions <= that.
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], seq_len).float()  # [L, Hkv, D]
        v = gather_kv(v_cache, block_tables[s], seq_len).float()
        k = k.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, L]
        o = F.scaled_dot_product_attention(q[q0:q1].float().transpose(0, 1), k, v, attn_mask=visible, scale=scale)
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------- norms, activation


def rms_norm(x, weight, eps=1e-6):
    """LlamaRMSNorm over the last dim, for any leading shape (also Qwen3's per-head q/k norm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """(rms_norm(x + residual), x + residual); the sum is rounded to the model dtype first, as HF does."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x):
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], computed in fp32, rounded once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# ---------------------------------------------------------------- RoPE


def rope_inv_freq(rotary_dim, base, rope_scaling=None):
    """Inverse frequencies [rotary_dim // 2], with the scaling transformers applies for this rope_type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # transformers' _compute_llama3_parameters: long wavelengths slowed by `factor`, short ones kept,
    # the band between blended smoothly.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin_cache(head_dim, max_pos, base=10000.0, rope_scaling=None, dtype=torch.float32, device=None):
    """[max_pos, rotary_dim]: cos in the first half, sin in the second (vLLM's layout).

    head_dim here is the rotary dim; pass a smaller one for partial rotary.
    """
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def _rope_one(x, cos, sin):
    rot = cos.shape[-1] * 2
    xf = x.float()
    x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2 : rot], xf[..., rot:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(x.dtype)


def apply_rope(q, k, positions, cos_sin_cache, inplace=False):
    """Neox (rotate-half) RoPE: q [T, H, D], k [T, Hkv, D] -> rotated copies (fp32 math, rounded once)."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2] each
    q_rot, k_rot = _rope_one(q, cos, sin), _rope_one(k, cos, sin)
    if inplace:
        return q.copy_(q_rot), k.copy_(k_rot)
    return q_rot, k_rot


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """apply_rope, then the rotated k and v written to the paged cache; -> rotated q."""
    q_rot, k_rot = apply_rope(q, k, positions, cos_sin_cache)
    write_kv_cache(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


# ---------------------------------------------------------------- skinny matmul (decode linears)


def skinny_matmul(x, weight, bias=None, gated=False, sumsq=None, eps=0.0, residual=None, weight_scale=None):
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x.dtype: fp32 math, rounded once.

    gated=True: weight packs [gate; up] and the result is silu_and_mul of the product, [M, N // 2].
    sumsq [n, M]: partial sums of x's squared rows; each product row is scaled by rsqrt(mean square + eps)
    (an RMSNorm whose weight was folded into weight's columns).
    residual [M, N]: -> (residual + product, the new rows' sums of squares as one partial [1, M]).
    weight_scale [N]: weight is e4m3, row n scaled by weight_scale[n] (weight-only FP8; x is not quantised).
    """
    y = x.float() @ weight.float().t()
    if weight_scale is not None:
        y = y * weight_scale.float()
    if sumsq is not None:
        y = y * torch.rsqrt(sumsq.sum(0) / x.shape[1] + eps)[:, None]
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        out = y.to(x.dtype) + residual  # added in the model dtype, as HF does
        return out, row_sum_squares(out)
    return silu_and_mul(y.to(x.dtype)) if gated else y.to(x.dtype)


def row_sum_squares(x):
    """x [M, K] -> [1, M] fp32: each row's sum of squares, as one partial (the sumsq of skinny_matmul)."""
    return x.float().square().sum(-1)[None]


def embed_rows(ids, table):
    """ids [M] -> (table[ids] [M, K], their sums of squares [1, M] fp32): a folded decode step's embeddings
    and the sumsq its first GEMV normalises them by."""
    rows = table[ids]
    return rows, row_sum_squares(rows)


# ---------------------------------------------------------------- greedy token choice


def argmax(logits):
    """[R, V] -> int64 [R]: the first index of each row's maximum (NaN counts as the largest)."""
    return logits.argmax(dim=-1)


# ---------------------------------------------------------------- the chosen token's logprob


def token_logprobs(logits, tokens, rows=None):
    """logits [R, V], tokens int [R], rows int [L] or None (every row) -> fp32 [L]: each picked row's log-softmax
    (in fp32) at its token."""
    if rows is not None:
        rows = rows.long()
        logits, tokens = logits.index_select(0, rows), tokens[rows]
    return torch.log_softmax(logits, dim=1, dtype=torch.float32).gather(1, tokens.long()[:, None]).squeeze(1)


# ---------------------------------------------------------------- FP8

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_per_token(x):
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def rms_norm_fp8(x, weight, eps=1e-6):
    """rms_norm(x) [T, D] quantised per token for an FP8 GEMM: (e4m3 [T, D], fp32 scale [T, 1])."""
    return quantize_fp8_per_token(rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(x, residual, weight, eps=1e-6):
    """-> (e4m3 rows, scales [T, 1], x + residual): fused_add_rms_norm with its output quantised per token."""
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    return (*quantize_fp8_per_token(normed), new_residual)


def silu_and_mul_fp8(x):
    """silu_and_mul(x) [T, I] quantised per token for an FP8 GEMM: (e4m3 [T, I], fp32 scale [T, 1])."""
    return quantize_fp8_per_token(silu_and_mul(x))


def quantize_weight_fp8(w):
    """Weight [N, K] -> (e4m3 [N, K], fp32 per-output-channel scale [N])."""
    q, scale = quantize_fp8_per_token(w)
    return q, scale.squeeze(-1)


def fp8_linear(x, w_fp8, w_scale, bias=None, out_dtype=None):
    """y = x @ W^T with W = w_fp8 * w_scale[:, None], x quantised per token: dequantise and matmul in fp32."""
    out_dtype = out_dtype or x.dtype
    xq, x_scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    return fp8_gemm(xq, x_scale, w_fp8, w_scale, bias, out_dtype).reshape(*x.shape[:-1], w_fp8.shape[0])


def fp8_gemm(xq, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """(xq * x_scale) @ (w_fp8 * w_scale[:, None])^T (+ bias) for rows already quantised per token, in fp32."""
    y = (xq.float() * x_scale) @ (w_fp8.float() * w_scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ---------------------------------------------------------------- sampling (the semantics of kernels/sampling.py)

# The row record: int32 [rows, >= SAMPLE_FIELDS], float fields as fp32 bit patterns. inv_temperature 0: a greedy
# row (left alone); top_k 0: off; top_p 1: off; log_min_p -inf: off; seed as two uint32 words; position: the
# index of the output token being drawn.
INV_TEMPERATURE, TOP_K, TOP_P, LOG_MIN_P, SEED_LO, SEED_HI, POSITION = range(7)
SAMPLE_FIELDS = 8
_M32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """(h * c) mod 2**32 for h in [0, 2**32) held in int64, without overflowing int64."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_uniform(seed_lo, seed_hi, position, tokens):
    """U(0, 1) fp32 keyed by (seed, output position, token id), bit for bit the kernel's: seed_lo, seed_hi,
    position int [R] (uint32 bit patterns), tokens int [V] -> [R, V]."""
    seed_lo, seed_hi, position = (t.long()[:, None] & _M32 for t in (seed_lo, seed_hi, position))
    a = _fmix32((_mul32(position, 0x9E3779B9) + 0x632BE5AB) & _M32)
    a = _fmix32(a ^ seed_hi)
    k1 = _fmix32(a ^ seed_lo)
    k2 = _fmix32((k1 + 0x7F4A7C15) & _M32)
    h = _fmix32(_fmix32((tokens.long()[None, :] + k1) & _M32) ^ k2)
    return unit_float(h)


def unit_float(h):
    """uint32 hash (int64 tensor) -> U(0, 1) fp32, as the kernel's _uniform: 23 bits, centred, so the top value,
    1 - 2**-24, stays below 1.0 in fp32 (24 bits round their top value to 1.0, which scored +inf)."""
    return ((h >> 9).float() + 0.5) * 2.0**-23


def sample(logits, params, out=None):
    """logits [R, V], params int32 [R, >= SAMPLE_FIELDS] -> int64 [R]: for each row with inv_temperature > 0,
    x = logits * inv_temperature in fp32; top-k keeps x >= the k-th largest x (ties at it all stay); top-p keeps,
    of those, each token whose strictly larger survivors hold less than top_p of the survivors' mass (the
    smallest set reaching top_p, ties at its edge kept, the top token always); min-p keeps x - max >= log_min_p;
    then argmax over the kept of x - log(-log u), u = counter_uniform (the exponential race, as Gumbel-max).
    Greedy rows of `out` are left as they are."""
    R, V = logits.shape
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    pf = params.view(torch.float32)
    rows = (pf[:, INV_TEMPERATURE] > 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    rec, recf = params[rows], pf[rows]
    x = logits[rows].float() * recf[:, INV_TEMPERATURE, None]
    x = torch.where(x == 0, 0.0, x)  # -0 as +0, as the kernel's ordered keys
    m = x.amax(dim=1, keepdim=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    k = rec[:, TOP_K].long()
    has_k = (k > 0) & (k < V)
    if has_k.any():
        kth = x.sort(dim=1, descending=True).values.gather(1, (k.clamp(1, V) - 1)[:, None])
        keep &= ~has_k[:, None] | (x >= kth)
    top_p = recf[:, TOP_P]
    has_p = top_p < 1.0
    if has_p.any():
        e = torch.where(keep, torch.exp(x - m), 0.0)
        target = top_p * e.sum(dim=1)
        desc, order = x.sort(dim=1, descending=True)
        e_desc = e.gather(1, order)
        before = torch.cat([torch.zeros_like(e_desc[:, :1]), e_desc.cumsum(dim=1)[:, :-1]], dim=1)
        first = torch.searchsorted((-desc).contiguous(), (-x).contiguous())  # first place of each value
        keep &= ~has_p[:, None] | (before.gather(1, first) < target[:, None])
    log_min_p = recf[:, LOG_MIN_P, None]
    keep &= (log_min_p == float("-inf")) | (x - m >= log_min_p)
    u = counter_uniform(rec[:, SEED_LO], rec[:, SEED_HI], rec[:, POSITION], torch.arange(V, device=x.device))
    score = torch.where(keep, x - torch.log(-torch.log(u)), float("-inf"))
    out[rows] = argmax(score)
    return out
