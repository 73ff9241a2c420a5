"""Kernels: the references against dense attention and textbook formulas (here), and every Triton
kernel against its reference under the Triton interpreter (test_kernels_triton.py, run from here).

TRITON_INTERPRET must be set before Triton itself is imported (its standard library is decorated
at import), so the interpreter tests run in a child process: this process, and the other tests in
it, keep an untouched environment and an ordinary Triton.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import interpreter
from pagefleet.kernels import reference as ref

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def close(actual, expected, dtype):
    """Relative Frobenius error against the (fp32) reference; NaN never passes."""
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all()
    err = ((a - e).norm() / e.norm().clamp(min=1e-12)).item()
    assert err < TOL[dtype], err


# ---------------------------------------------------------------- paged-cache fixtures


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen, pad=-1):
    """A cache holding random K/V for each sequence in shuffled (non-contiguous) blocks, plus its table."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), width), pad, dtype=torch.int32)
    i = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[i : i + nb].int()
        i += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def dense_attention(q, k, v, q_pos):
    """Textbook causal attention for one sequence: q [n, H, D], k/v [L, Hkv, D] contiguous."""
    H, Hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(H // Hkv, 1).transpose(0, 1)
    v = v.double().repeat_interleave(H // Hkv, 1).transpose(0, 1)
    mask = torch.arange(k.shape[1])[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


# ---------------------------------------------------------------- references against dense attention


@pytest.mark.parametrize("group", [1, 4])
def test_reference_decode_matches_dense(group):
    gen = torch.Generator().manual_seed(0)
    lens = [1, 17, 40, 33]
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 16, 16, torch.float32, gen)
    q = torch.randn(len(lens), 2 * group, 16, generator=gen)
    out = ref.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens)
    for s, n in enumerate(lens):
        k = ref.gather_kv(k_cache, bt[s], n)
        v = ref.gather_kv(v_cache, bt[s], n)
        expected = dense_attention(q[s : s + 1], k, v, torch.tensor([n - 1]))
        close(out[s : s + 1], expected, torch.float32)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_prefill_matches_dense(group):
    gen = torch.Generator().manual_seed(1)
    lens, q_lens = [20, 37, 5], [20, 9, 1]  # full prefill, chunk after a cached prefix, a decode token
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 16, 16, torch.float32, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 2 * group, 16, generator=gen)
    out = ref.paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu)
    for s, (n, ql) in enumerate(zip(lens, q_lens, strict=True)):
        k, v = ref.gather_kv(k_cache, bt[s], n), ref.gather_kv(v_cache, bt[s], n)
        expected = dense_attention(q[cu[s] : cu[s + 1]], k, v, torch.arange(n - ql, n))
        close(out[cu[s] : cu[s + 1]], expected, torch.float32)


def test_reference_write_kv_cache():
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ref.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([35, -1, 2]))
    assert torch.equal(k_cache[2, 3], k[0]) and torch.equal(v_cache[0, 2], v[2])
    assert k_cache.count_nonzero() == 2 * 2 * 8  # the -1 slot wrote nothing


def test_reference_rms_norm_is_hf_formula():
    x, w = torch.randn(5, 3, 64).half(), torch.randn(64).half()
    h = x.float()
    expected = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert torch.equal(ref.rms_norm(x, w, 1e-6), expected)


def test_reference_rope_cache_llama3():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv = ref.rope_inv_freq(128, 500000.0, scaling)
    plain = ref.rope_inv_freq(128, 500000.0)
    assert torch.allclose(inv[:8], plain[:8])  # high frequencies untouched
    assert torch.allclose(inv[-8:], plain[-8:] / 8)  # low frequencies slowed by the factor
    cache = ref.rope_cos_sin_cache(128, 32, 500000.0, scaling)
    assert cache.shape == (32, 128) and torch.allclose(cache[5, :64], torch.cos(5 * inv))


def test_reference_rope_is_rotate_half():
    q, k = torch.randn(4, 3, 16), torch.randn(4, 1, 16)
    pos = torch.tensor([0, 3, 7, 2])
    cache = ref.rope_cos_sin_cache(16, 10)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def rotate_half(x):
        return torch.cat([-x[..., 8:], x[..., :8]], -1)

    q2, k2 = ref.apply_rope(q, k, pos, cache)
    assert torch.allclose(q2, q * cos + rotate_half(q) * sin, atol=1e-6)
    assert torch.allclose(k2, k * cos + rotate_half(k) * sin, atol=1e-6)


def test_reference_fp8_linear_close_to_matmul():
    x, w = torch.randn(8, 64), torch.randn(32, 64)
    wq, ws = ref.quantize_weight_fp8(w)
    y = ref.fp8_linear(x, wq, ws)
    assert ((y - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.1


def test_reference_decode_writes_into_out():
    """`out` is honoured: a mixed step writes its decode and prefill attention into two parts of one buffer."""
    k_cache, v_cache, bt, seq_lens = make_paged([5, 20], 1, 8, 16, torch.float32, torch.Generator().manual_seed(0))
    q, out = torch.randn(2, 2, 8), torch.full((3, 2, 8), float("nan"))
    ref.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out[:2])
    assert torch.equal(out[:2], ref.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens))
    assert out[2].isnan().all()


# ---------------------------------------------------------------- arrival counters, Triton kernels


def test_arrival_counters_grow_and_keep_the_buffers_graphs_may_hold():
    """More counters than the buffer holds (e.g. argmax over more rows): a larger zeroed buffer replaces it
    outside a capture, and the smaller one stays alive for any CUDA graph captured with it."""
    from pagefleet.kernels import arrivals

    small = arrivals.counters("cpu", 1)
    big = arrivals.counters("cpu", arrivals.SIZE + 7)
    assert big.numel() >= arrivals.SIZE + 7 and not big.any()
    assert arrivals.counters("cpu", 0) is big
    assert any(b is small for b in arrivals._retired)


@pytest.mark.interpreter("kernels")
def test_triton_kernels_under_interpreter():
    """Every Triton kernel against its reference on tiny CPU shapes (fp32, fp16), in a child process."""
    pytest.importorskip("triton")
    interpreter.check("kernels", timeout=840)


@pytest.mark.interpreter("gdn")
def test_gdn_triton_kernels_under_interpreter():
    """The Gated DeltaNet kernels (conv, recurrent step, chunked rule) against gdn_reference, in a child process."""
    pytest.importorskip("triton")
    interpreter.check("gdn", timeout=840)


@pytest.mark.interpreter("gdn_tile_bench")
def test_gdn_tile_bench_runs_under_interpreter():
    """benchmarks/gdn_tile_bench.py end to end on tiny shapes (--dry-run): every variant it would time on the GPU
    is checked against the reference first, decode tiles and chunked-rule launches alike."""
    pytest.importorskip("triton")
    stdout = interpreter.check("gdn_tile_bench", timeout=840)
    assert stdout.count("every variant matches the reference") == 2, stdout[-3000:]
