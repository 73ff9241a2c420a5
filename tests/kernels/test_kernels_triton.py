"""Triton kernels against their references under the Triton interpreter (tiny shapes, fp32 / fp16).

Runs only with TRITON_INTERPRET=1 set before Python starts: test_kernels.py launches it that way in a
child process. Directly: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_kernels_triton.py
Over 300 lines because every kernel's interpreter test lives here: one child process runs them all, and
the interpreter's import of Triton is paid once.
"""
import importlib
import os

import pytest
import torch
from test_kernels import DTYPES, close, make_paged

from pagefleet.kernels import reference as ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests: run by test_kernels.py in a child process")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.importorskip("triton")
    TK = {name: importlib.import_module(f"pagefleet.kernels.{name}") for name in (
        "activation", "arrivals", "attention", "cascade", "fp8", "fp8_skinny", "gemv", "greedy", "kv_cache", "norm",
        "prefill_attention", "rope")}

# ---------------------------------------------------------------- Triton (interpreter) against references

# Decode splits: 1 (no partials), 3 (a padded split count) and 16, the most the engine picks, where most slices
# of these short sequences are empty. 16 splits cost the interpreter three times 3's, and run fp32 only: the dtype
# meets the loads and the output store, which 1 and 3 cover in both; the partials and their merge are fp32 always.
SPLIT_CASES = [pytest.param(dtype, n, id=f"{str(dtype).removeprefix('torch.')}-{n}")
               for dtype, n in [(dtype, n) for n in (1, 3) for dtype in DTYPES] + [(torch.float32, 16)]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_kv_cache(dtype):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 3 * 2 * 16, generator=gen).to(dtype)  # k, v as strided views of a fused qkv
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([17, -1, 3, 40, -1])
    caches = [torch.randn(4, 16, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    TK["kv_cache"].write_kv_cache(k, v, caches[0], caches[1], slots)
    ref.write_kv_cache(k, v, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("dtype,num_splits", SPLIT_CASES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("merge", [True, False])  # split partials merged in the kernel or by a second launch
def test_triton_decode_attention(dtype, group, num_splits, merge):
    gen = torch.Generator().manual_seed(3)
    lens = [1, 50, 16, 33]  # one token, several blocks, an exact block, a partial tail
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 32, 16, dtype, gen)
    for _ in range(2):  # the in-kernel merge's counters must be back at 0 for the next launch
        q = torch.randn(len(lens), 2 * group, 32, generator=gen).to(dtype)
        expected = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, seq_lens)
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        TK["attention"].paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out, num_splits=num_splits,
                                               block_n=16, merge=merge)
        close(out, expected, dtype)
    assert not TK["arrivals"].counters(q.device, 0).any()


@pytest.mark.parametrize("dtype,num_splits", SPLIT_CASES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
@pytest.mark.parametrize("in_kernel", [True, False])  # False: a batch past ROPE_MAX_BATCH, RoPE launched first
def test_triton_decode_attention_with_rope(dtype, group, num_splits, rot, in_kernel, monkeypatch):
    """new_kv=: the decode launch rotates q and the new k and writes k, v to the last slot of each sequence
    itself. Against the two launches it replaces (rope_and_write_kv, then the decode attention): the same
    caches, bit for bit, and the same output. The third sequence is a padding row (slot -1): no write."""
    monkeypatch.setattr(TK["attention"], "ROPE_MAX_BATCH", 64 if in_kernel else 1)
    gen = torch.Generator().manual_seed(6)
    lens = [1, 50, 16, 33]
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 32, 16, dtype, gen)
    positions = seq_lens.long() - 1
    slots = torch.tensor([int(bt[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(lens)])
    slots[2] = -1
    qkv = torch.randn(len(lens), (2 * group + 4) * 32, generator=gen).to(dtype)  # q, k, v as views of one row
    q = qkv[:, : 2 * group * 32].view(-1, 2 * group, 32)
    k = qkv[:, 2 * group * 32 : (2 * group + 2) * 32].view(-1, 2, 32)
    v = qkv[:, (2 * group + 2) * 32 :].view(-1, 2, 32)
    cos_sin = ref.rope_cos_sin_cache(rot, 64, 10000.0)
    caches = (k_cache.clone(), v_cache.clone())
    q_rot = TK["rope"].rope_and_write_kv(q, k, v, positions, cos_sin, *caches, slots)
    expected = TK["attention"].paged_decode_attention(q_rot, *caches, bt, seq_lens, num_splits=num_splits, block_n=16)
    out = torch.full_like(q, float("nan"))
    TK["attention"].paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out, num_splits=num_splits,
                                           block_n=16, new_kv=(k, v, positions, cos_sin, slots))
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert torch.equal(out, expected)
    close(out, ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, seq_lens,
                                          new_kv=(k.float(), v.float(), positions, cos_sin, slots)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_triton_cascade_decode_attention(dtype, group):
    """Groups of rows sharing their first blocks (the samples of one prompt): the shared prefix attended once per
    group, each row's own keys after it, merged; against the plain decode reference over each row's whole table.
    Rows 0-2 share two blocks and have tails of their own, row 3 shares nothing, rows 4-5 share one block, row 5's
    own part a single key; a group's prefix may end inside the table's last shared block (row 4 holds 3 blocks)."""
    gen = torch.Generator().manual_seed(12)
    bs, hkv, d = 16, 2, 32
    lens = [45, 40, 33, 20, 40, 17]
    leaders = [0, 0, 0, None, 4, 4]
    prefix_blocks = {0: 2, 4: 1}
    k_cache = torch.randn(40, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(40, bs, hkv, d, generator=gen).to(dtype)
    free = torch.randperm(40, generator=gen).tolist()
    shared = {lead: [free.pop() for _ in range(nb)] for lead, nb in prefix_blocks.items()}
    bt = torch.full((len(lens), 4), -1, dtype=torch.int32)
    for b, (n, lead) in enumerate(zip(lens, leaders, strict=True)):
        own = list(shared.get(lead, []))
        own += [free.pop() for _ in range(-(-n // bs) - len(own))]
        bt[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    groups = torch.tensor([[0, 3, 32], [4, 2, 16]], dtype=torch.int32)
    prefix_lens = torch.tensor([32, 32, 32, 0, 16, 16], dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    expected = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, seq_lens)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    TK["cascade"].cascade_decode_attention(q, k_cache, v_cache, bt, seq_lens, groups, prefix_lens, out=out,
                                           block_n=16)
    close(out, expected, dtype)
    assert TK["cascade"].samples_per_program(hkv * group, hkv) == {1: 64, 4: 16}[group]


def test_triton_decode_stale_max_seq_len():
    """A max_seq_len hint shorter than the real lengths (a CUDA graph captured earlier) stays correct."""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, bt, seq_lens = make_paged([70, 9], 1, 16, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens)
    out = TK["attention"].paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, max_seq_len=20, num_splits=2,
                                                 block_n=16)
    close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_triton_prefill_attention(dtype, group):
    gen = torch.Generator().manual_seed(4)
    lens, q_lens = [21, 45, 6, 17], [21, 12, 1, 0]  # prefill, chunk after a cached prefix, decode, idle
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 32, 16, dtype, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 2 * group, 32, generator=gen).to(dtype)
    expected = ref.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), bt, seq_lens, cu)
    out = torch.full_like(q, float("nan"))
    TK["prefill_attention"].paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu, out=out, block_m=16,
                                                    block_n=16)
    close(out, expected, dtype)


def test_triton_prefill_attention_padded_as_a_prompt_graph_stages_it():
    """Padding sequences with no tokens and no keys at the end, and token rows past the last sequence (the
    prompt graphs' bucket padding): the real rows match the reference, the padding rows are never written."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, bt, seq_lens = make_paged([21, 30, 0, 0], 2, 32, 16, torch.float32, gen)
    bt[2:] = 0  # the graphs' padding rows: zeros, never read
    cu = torch.tensor([0, 21, 30, 30, 30], dtype=torch.int32)  # queries of 21 and 9 tokens (the second has 21 cached)
    q = torch.randn(48, 4, 32, generator=gen)  # a 48-token bucket
    expected = ref.paged_prefill_attention(q[:30], k_cache, v_cache, bt[:2], seq_lens[:2], cu[:3])
    out = torch.full_like(q, float("nan"))
    TK["prefill_attention"].paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu, out=out, block_m=16,
                                                    block_n=16)
    close(out[:30], expected, torch.float32)
    assert out[30:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_embed_rows(dtype):
    """Rows gathered exactly (a row twice, the last row), a hidden size not a power of two, their sums of
    squares in fp32."""
    gen = torch.Generator().manual_seed(6)
    table = torch.randn(50, 70, generator=gen).to(dtype)
    ids = torch.tensor([3, 49, 3, 0, 17])
    rows, sumsq = TK["norm"].embed_rows(ids, table)
    exp_rows, exp_sumsq = ref.embed_rows(ids, table)
    assert torch.equal(rows, exp_rows) and sumsq.shape == (1, 5) and sumsq.dtype == torch.float32
    close(sumsq, exp_sumsq, torch.float32)
    rows, sumsq = TK["norm"].embed_rows(ids[:0], table)
    assert rows.shape == (0, 70) and sumsq.shape == (1, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm(dtype):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(70, 48, generator=gen).to(dtype)  # 3 programs of 32 rows, the last partial
    close(TK["norm"].rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), dtype)
    qkv = torch.randn(13, 5 * 48, generator=gen).to(dtype)  # per-head q norm on a strided [T, H, D] view
    q = qkv[:, : 4 * 48].view(13, 4, 48)
    close(TK["norm"].rms_norm(q, w), ref.rms_norm(q, w), dtype)
    r = torch.randn(70, 48, generator=gen).to(dtype)
    normed, new_res = TK["norm"].fused_add_rms_norm(x, r, w, 1e-5)
    exp_normed, exp_res = ref.fused_add_rms_norm(x, r, w, 1e-5)
    close(normed, exp_normed, dtype)
    assert torch.equal(new_res, exp_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
def test_triton_rope(dtype, rot):
    gen = torch.Generator().manual_seed(6)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cache = ref.rope_cos_sin_cache(rot, 256, 10000.0, scaling)
    qkv = torch.randn(7, 6 * 32, generator=gen).to(dtype)
    q, k = qkv[:, : 4 * 32].view(7, 4, 32), qkv[:, 4 * 32 : 5 * 32].view(7, 1, 32)
    pos = torch.randint(0, 256, (7,), generator=gen)
    got, expected = TK["rope"].apply_rope(q, k, pos, cache), ref.apply_rope(q, k, pos, cache)
    close(got[0], expected[0], dtype)
    close(got[1], expected[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
def test_triton_rope_and_write_kv(dtype, rot):
    """The fused form: rotated q returned, rotated k and v in their slots, padding slots untouched; the
    same bits as apply_rope followed by write_kv_cache."""
    gen = torch.Generator().manual_seed(14)
    cache = ref.rope_cos_sin_cache(rot, 256, 10000.0)
    qkv = torch.randn(5, 8 * 32, generator=gen).to(dtype)  # q 4 heads, k and v 2 heads each, one fused row
    q, k, v = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32), qkv[:, 192:].view(5, 2, 32)
    pos = torch.randint(0, 256, (5,), generator=gen)
    slots = torch.tensor([17, -1, 3, 40, -1])
    caches = [torch.randn(4, 16, 2, 32, generator=gen).to(dtype) for _ in range(2)]
    expected, two_step = [c.clone() for c in caches], [c.clone() for c in caches]
    q_rot = TK["rope"].rope_and_write_kv(q, k, v, pos, cache, caches[0], caches[1], slots)
    q_exp = ref.rope_and_write_kv(q, k, v, pos, cache, expected[0], expected[1], slots)
    close(q_rot, q_exp, dtype)
    close(caches[0], expected[0], dtype)
    assert torch.equal(caches[1], expected[1])  # values are copied, not computed
    q_two, k_two = TK["rope"].apply_rope(q, k, pos, cache)
    TK["kv_cache"].write_kv_cache(k_two, v, two_step[0], two_step[1], slots)
    assert torch.equal(q_rot, q_two) and torch.equal(caches[0], two_step[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(7)).to(dtype)
    close(TK["activation"].silu_and_mul(x), ref.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_triton_argmax(dtype, num_chunks):
    """First index of the maximum per row, as torch.argmax: ties across chunks and within a block, a NaN,
    the last index, a row of -inf, a partial tail block; twice, so the per-row counters must be back at 0."""
    gen = torch.Generator().manual_seed(12)
    for _ in range(2):
        x = torch.randn(6, 1000, generator=gen).to(dtype)
        x[1, [70, 900]] = 9.0  # a tie in different chunks: the first wins
        x[2, [3, 4]] = 9.0  # a tie inside one block
        x[3, 500] = float("nan")
        x[4, 999] = 9.0
        x[5] = float("-inf")  # every logit banned: index 0, as torch
        got = TK["greedy"].argmax(x, num_chunks=num_chunks, block=64)
        assert got.dtype == torch.int64 and torch.equal(got, ref.argmax(x)), (got, ref.argmax(x))
    assert not TK["arrivals"].counters(x.device, 0).any()


def assert_e4m3_equal(q, q_ref):
    """The interpreter's fp32 -> e4m3 cast is not the GPU's round-to-nearest-even: it halves values just under
    a power of two (124 -> 64, not 128), truncates small ones (0.0092 -> 4/512, not 5/512) and breaks some
    ties upward (5.25 -> 5.5, not 5.0). Allow a neighbouring e4m3 value or that halving here; the GPU tests
    demand equality."""
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape
    a, b = q.float(), q_ref.float()
    off = a != b
    assert off.float().mean() < 0.1

    def magnitude(t):  # e4m3 bit patterns order like their values
        return (t.view(torch.uint8) & 0x7F).int()

    neighbour = ((magnitude(q_ref) - magnitude(q)).abs() == 1) & (a.sign() * b.sign() >= 0)
    halved = (a * 2 == b) & (torch.log2(b.abs()).round() == torch.log2(b.abs()))
    assert (neighbour | halved)[off].all(), (a[off & ~(neighbour | halved)], b[off & ~(neighbour | halved)])


def test_triton_fp8_quantize():
    x = torch.randn(4, 80, generator=torch.Generator().manual_seed(8)) * torch.tensor([[1.0], [10], [0.01], [3]])
    q, scale = TK["fp8"].quantize_fp8_per_token(x)
    q_ref, scale_ref = ref.quantize_fp8_per_token(x)
    assert torch.equal(scale, scale_ref)
    assert_e4m3_equal(q, q_ref)


@pytest.mark.parametrize("M", [33, 64, 100])  # one 64-row tile; 100 padded to 128, rows wrapping round
@pytest.mark.parametrize("split_k", [1, 3])
def test_triton_fp8_skinny_gemm(M, split_k):
    """Quantised rows @ e4m3 weight: N = 80 (a partial 32-row tile whose rows wrap round), K = 96 in 32-wide
    tiles, 3 slices merged by the last to arrive (its counter back at 0), bias, poisoned out; against the fp32
    product of the dequantised operands."""
    gen = torch.Generator().manual_seed(17)
    xq, x_scale = ref.quantize_fp8_per_token(torch.randn(M, 96, generator=gen) * torch.rand(M, 1, generator=gen))
    w8, w_scale = ref.quantize_weight_fp8(torch.randn(80, 96, generator=gen))
    bias = torch.randn(80, generator=gen)
    for b in (bias, None):
        out = torch.full((M, 80), float("nan"))
        TK["fp8_skinny"].fp8_skinny_gemm(xq, x_scale, w8, w_scale, b, out_dtype=torch.float32, out=out, block_n=32,
                                         block_k=32, split_k=split_k)
        close(out, ref.fp8_gemm(xq, x_scale, w8, w_scale, b, torch.float32), torch.float32)
        assert not TK["arrivals"].counters(out.device, 0).any()
    got = TK["fp8_skinny"].fp8_skinny_gemm(xq, x_scale, w8, w_scale, block_n=32, block_k=64)  # 64 does not divide
    assert got.dtype == torch.bfloat16                                                        # K: 32-wide tiles
    close(got, ref.fp8_gemm(xq, x_scale, w8, w_scale), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_norms_and_activation_quantised_for_fp8(dtype):
    """rms_norm, fused_add_rms_norm and silu_and_mul writing e4m3 rows and per-token scales: what the plain
    kernel's output gives through quantize_fp8_per_token. Rows of very different sizes; silu_and_mul also
    with rows longer than one tile (2,100 columns: two passes of two tiles)."""
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(48, generator=gen).to(dtype)
    x = (torch.randn(70, 48, generator=gen) * torch.logspace(-2, 2, 70)[:, None]).to(dtype)
    r = torch.randn(70, 48, generator=gen).to(dtype)
    q, scale = TK["norm"].rms_norm_fp8(x, w, 1e-5)
    q_ref, scale_ref = ref.quantize_fp8_per_token(TK["norm"].rms_norm(x, w, 1e-5))
    assert torch.equal(scale, scale_ref)
    assert_e4m3_equal(q, q_ref)
    q, scale, res = TK["norm"].fused_add_rms_norm_fp8(x, r, w, 1e-5)
    normed, res_ref = TK["norm"].fused_add_rms_norm(x, r, w, 1e-5)
    q_ref, scale_ref = ref.quantize_fp8_per_token(normed)
    assert torch.equal(res, res_ref) and torch.equal(scale, scale_ref)
    assert_e4m3_equal(q, q_ref)
    for rows, inter in ((5, 40), (3, 2100)):
        xm = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
        q, scale = TK["activation"].silu_and_mul_fp8(xm)
        q_ref, scale_ref = ref.quantize_fp8_per_token(TK["activation"].silu_and_mul(xm))
        assert torch.equal(scale, scale_ref)
        assert_e4m3_equal(q, q_ref)
    # the reference dequantises to the norm within e4m3's precision (3 mantissa bits: 1/16 relative)
    q, scale = ref.rms_norm_fp8(x, w, 1e-5)
    expected = ref.rms_norm(x, w, 1e-5).float()
    assert ((q.float() * scale - expected).norm() / expected.norm()).item() < 1 / 16


@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_attention_odd_shapes(block_size):
    """head_dim not a power of two (padded lanes) and 3 query heads per KV head (padded rows)."""
    gen = torch.Generator().manual_seed(10)
    k_cache, v_cache, bt, seq_lens = make_paged([45, 70], 2, 24, block_size, torch.float32, gen)
    q = torch.randn(2, 6, 24, generator=gen)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens)
    close(TK["attention"].paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, num_splits=2, block_n=32),
          expected, torch.float32)
    cu = torch.tensor([0, 45, 48], dtype=torch.int32)  # queries of 45 (the whole first sequence) and 3 tokens
    q = torch.randn(48, 6, 24, generator=gen)
    expected = ref.paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu)
    close(TK["prefill_attention"].paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu, block_m=16,
                                                          block_n=32),
          expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16, 24])  # 24: padded to 32 rows (decode graphs of 17-32 sequences)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_triton_gemv(dtype, M, split_k):
    """K = 100 (a K tail after whole 32-wide tiles), N = 70 (a partial 16-row tile), bias, poisoned out.
    Split K: the last slice to finish merges, and leaves its counter at 0 for the next launch."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(M, 100, generator=gen).to(dtype)
    w = torch.randn(70, 100, generator=gen).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    out = torch.full((M, 70), float("nan"), dtype=dtype)
    TK["gemv"].skinny_matmul(x, w, bias, out=out, block_n=16, block_k=32, split_k=split_k)
    close(out, ref.skinny_matmul(x.float(), w.float(), bias.float()), dtype)
    got = TK["gemv"].skinny_matmul(x, w, block_n=16, block_k=32, split_k=split_k)
    assert got.shape == (M, 70) and got.dtype == dtype
    close(got, ref.skinny_matmul(x.float(), w.float()), dtype)
    assert not TK["arrivals"].counters(x.device, 0).any()


def test_triton_gemv_split_without_counters_warns_and_runs_unsplit(monkeypatch):
    """A graph captured before arrivals.reserve has no counters: the split GEMV says so and stays correct."""
    gen = torch.Generator().manual_seed(16)
    x, w = torch.randn(3, 100, generator=gen), torch.randn(70, 100, generator=gen)
    monkeypatch.setattr(TK["gemv"], "counters", lambda device, n: None)
    with pytest.warns(RuntimeWarning, match="arrivals.reserve"):
        got = TK["gemv"].skinny_matmul(x, w, block_n=16, block_k=32, split_k=3)
    close(got, ref.skinny_matmul(x, w), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("K", [100, 128])  # a K tail, and whole tiles only
def test_triton_gemv_gated(dtype, M, K):
    """gated=True: silu(x @ gate.T) * (x @ up.T) from a packed [gate; up] weight, bias included; the
    same bits as the unfused GEMV followed by the silu-and-mul kernel."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(2 * 40, K, generator=gen).to(dtype)
    bias = torch.randn(2 * 40, generator=gen).to(dtype)
    out = torch.full((M, 40), float("nan"), dtype=dtype)
    TK["gemv"].skinny_matmul(x, w, bias, out=out, block_n=16, block_k=32, gated=True)
    close(out, ref.skinny_matmul(x.float(), w.float(), bias.float(), gated=True), dtype)
    unfused = TK["activation"].silu_and_mul(TK["gemv"].skinny_matmul(x, w, bias, block_n=16, block_k=32))
    assert torch.equal(out, unfused)
    split = TK["gemv"].skinny_matmul(x, w, bias, block_n=16, block_k=32, gated=True, split_k=3)  # silu after the merge
    close(split, ref.skinny_matmul(x.float(), w.float(), bias.float(), gated=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5])
def test_triton_gemv_folded_norm(dtype, M):
    """residual=: out = residual + x @ w.T + bias, and each program's sums of out's squared rows over its
    columns. sumsq=: the GEMV after it, with an RMSNorm's weight g folded into its weight, equals the GEMV
    of rms_norm(out, g), plain and gated. N = 70: five 16-row programs, the last one partial."""
    gen = torch.Generator().manual_seed(14)
    x, w = torch.randn(M, 100, generator=gen).to(dtype), torch.randn(70, 100, generator=gen).to(dtype)
    bias, residual = torch.randn(70, generator=gen).to(dtype), torch.randn(M, 70, generator=gen).to(dtype)
    out, sumsq = TK["gemv"].skinny_matmul(x, w, bias, block_n=16, block_k=32, residual=residual)
    expected, _ = ref.skinny_matmul(x.float(), w.float(), bias.float(), residual=residual.float())
    close(out, expected, dtype)
    assert sumsq.shape == (5, M) and sumsq.dtype == torch.float32
    close(sumsq.sum(0), out.float().square().sum(-1), torch.float32)

    g, eps = 1 + 0.5 * torch.randn(70, generator=gen), 1e-5
    w2 = torch.randn(2 * 40, 70, generator=gen)
    folded = (w2 * g).to(dtype)
    normed = ref.rms_norm(out.float(), g, eps)
    b2 = torch.randn(80, generator=gen)  # the bias comes after the row scale, as after a norm
    got = torch.full((M, 80), float("nan"), dtype=dtype)
    TK["gemv"].skinny_matmul(out, folded, b2.to(dtype), out=got, sumsq=sumsq, eps=eps, block_n=16, block_k=32)
    close(got, ref.skinny_matmul(normed, w2, b2.to(dtype).float()), dtype)
    gated = TK["gemv"].skinny_matmul(out, folded, sumsq=sumsq, eps=eps, gated=True, block_n=16, block_k=32)
    close(gated, ref.skinny_matmul(normed, w2, gated=True), dtype)

    # split K: the residual add, its sums of squares and the rstd scale apply to the merged sum
    split, split_sumsq = TK["gemv"].skinny_matmul(x, w, bias, block_n=16, block_k=32, residual=residual, split_k=3)
    close(split, expected, dtype)
    close(split_sumsq.sum(0), split.float().square().sum(-1), torch.float32)
    split_normed = TK["gemv"].skinny_matmul(out, folded, b2.to(dtype), sumsq=sumsq, eps=eps, block_n=16, block_k=32,
                                            split_k=2)
    close(split_normed, ref.skinny_matmul(normed, w2, b2.to(dtype).float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 20])  # 20: padded to 32 rows, as FP8 decode graphs of 17-32 sequences
def test_triton_gemv_fp8_weight(dtype, M):
    """weight_scale=: e4m3 weights, one fp32 scale a row, x unquantised. Plain (with split-K), gated (the up
    half has its own scales) and with the folded-norm options, each against the reference over the
    dequantised weight; and the scale really applies: a weight quantised with doubled scales gives twice."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(M, 100, generator=gen).to(dtype)
    w8, scale = ref.quantize_weight_fp8(torch.randn(70, 100, generator=gen) * torch.rand(70, 1, generator=gen))
    bias = torch.randn(70, generator=gen).to(dtype)
    dequant = w8.float() * scale[:, None]
    for split_k in (1, 2):
        out = torch.full((M, 70), float("nan"), dtype=dtype)
        TK["gemv"].skinny_matmul(x, w8, bias, out=out, block_n=16, block_k=32, split_k=split_k, weight_scale=scale)
        close(out, ref.skinny_matmul(x.float(), dequant, bias.float()), dtype)
        close(out, ref.skinny_matmul(x.float(), w8, bias.float(), weight_scale=scale), dtype)
    doubled = TK["gemv"].skinny_matmul(x, w8, block_n=16, block_k=32, weight_scale=2 * scale)
    close(doubled, 2 * ref.skinny_matmul(x.float(), dequant), dtype)

    g8, g_scale = ref.quantize_weight_fp8(torch.randn(2 * 40, 100, generator=gen))
    g_scale[40:] *= 3  # up's rows scaled apart from gate's
    gated = TK["gemv"].skinny_matmul(x, g8, block_n=16, block_k=32, gated=True, weight_scale=g_scale)
    close(gated, ref.skinny_matmul(x.float(), g8.float() * g_scale[:, None], gated=True), dtype)

    residual = torch.randn(M, 70, generator=gen).to(dtype)
    h, sumsq = TK["gemv"].skinny_matmul(x, w8, residual=residual, block_n=16, block_k=32, weight_scale=scale)
    close(h, ref.skinny_matmul(x.float(), dequant, residual=residual.float())[0], dtype)
    w2, eps = torch.randn(2 * 40, 70, generator=gen), 1e-5
    q2, s2 = ref.quantize_weight_fp8(w2)
    got = TK["gemv"].skinny_matmul(h, q2, sumsq=sumsq, eps=eps, gated=True, block_n=16, block_k=32, weight_scale=s2)
    expected = ref.skinny_matmul(ref.rms_norm(h.float(), torch.ones(70), eps), q2.float() * s2[:, None], gated=True)
    close(got, expected, dtype)
    for split_k in (2, 3):  # every slice normalises its own x tiles; the scales apply after the merge
        got = TK["gemv"].skinny_matmul(h, q2, sumsq=sumsq, eps=eps, gated=True, block_n=16, block_k=32,
                                       weight_scale=s2, split_k=split_k)
        close(got, expected, dtype)
        split_h, _ = TK["gemv"].skinny_matmul(x, w8, residual=residual, block_n=16, block_k=32, weight_scale=scale,
                                              split_k=split_k)
        close(split_h, h, dtype)
    with pytest.raises(AssertionError):
        TK["gemv"].skinny_matmul(x, w8, weight_scale=scale.half())  # fp32 scales only


def test_triton_gemv_strided_and_defaults():
    """x and out as row views of wider buffers; the default config; M = 1 with a 64-wide K tile."""
    gen = torch.Generator().manual_seed(12)
    xs = torch.randn(5, 96, generator=gen)[:, :80]  # row stride 96, K = 80
    w = torch.randn(40, 80, generator=gen)
    outs = torch.full((5, 64), float("nan"))
    TK["gemv"].skinny_matmul(xs, w, out=outs[:, :40])
    close(outs[:, :40], ref.skinny_matmul(xs, w), torch.float32)
    assert torch.isnan(outs[:, 40:]).all()  # nothing written past N
    x1 = xs[:1]
    close(TK["gemv"].skinny_matmul(x1, w, block_n=16, block_k=64), ref.skinny_matmul(x1, w), torch.float32)
    with pytest.raises(ValueError):
        TK["gemv"].skinny_matmul(x1, w, block_n=8)  # tl.dot needs 16 rows


# ---------------------------------------------------------------- fp8 KV cache (--kv-cache-dtype fp8)

FP8 = torch.float8_e4m3fn


def same_fp8(actual, expected):
    """Two e4m3 caches hold the same values, to the interpreter's casts: they flush e4m3 subnormals (below 2**-6)
    where torch rounds them, and a value that rounds up into the next power of two can lose the carry and
    halve (0.49 -> 0.25, 7.9 -> 4). The GPU's casts are checked bit for bit in test_kernels_gpu.py."""
    a, e = actual.float(), expected.float()
    assert torch.isfinite(a).all()
    differ = (a != e) & ((e.abs() >= 2**-6) | (a.abs() >= 2**-6))
    assert ((a[differ] == e[differ] / 2) | ((a[differ] - e[differ]).abs() <= e[differ].abs() / 8)).all()
    assert differ.float().mean() < 0.05  # the carry cases, a few in a hundred values of randn's spread


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_kv_cache_fp8_saturates(dtype):
    """Keys and values written to an e4m3 cache land in their slots and saturate at +-448 instead of turning into
    NaN (a plain cast's result past e4m3's range). The values in range are e4m3 values already: the interpreter
    rounds [7.75, 8) down to 4 (a lost carry), so the rounding itself is checked on the GPU
    (test_kernels_gpu.py)."""
    gen = torch.Generator().manual_seed(21)
    k, v = ((torch.randn(5, 2, 16, generator=gen) * 40).to(FP8).float() for _ in range(2))
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 460.0])
    v[3, 1, :2] = torch.tensor([-5e4, 6e4])
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.tensor([17, -1, 3, 40, -1])
    caches = [torch.zeros(4, 16, 2, 16, dtype=FP8) for _ in range(2)]
    expected = [c.clone() for c in caches]
    TK["kv_cache"].write_kv_cache(k, v, caches[0], caches[1], slots)
    ref.write_kv_cache(k, v, expected[0], expected[1], slots)
    same_fp8(caches[0], expected[0])
    same_fp8(caches[1], expected[1])
    assert caches[0][1, 1, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 448.0]
    assert caches[1][2, 8, 1, :2].float().tolist() == [-448.0, 448.0]


@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary (the tail is copied into the cache)
def test_triton_rope_and_write_kv_fp8(rot):
    gen = torch.Generator().manual_seed(22)
    cache = ref.rope_cos_sin_cache(rot, 256, 10000.0)
    q, k, v = (torch.randn(5, h, 32, generator=gen).half() for h in (4, 2, 2))
    pos = torch.randint(0, 256, (5,), generator=gen)
    slots = torch.tensor([17, -1, 3, 40, -1])
    caches = [torch.zeros(4, 16, 2, 32, dtype=FP8) for _ in range(2)]
    expected = [c.clone() for c in caches]
    q_rot = TK["rope"].rope_and_write_kv(q, k, v, pos, cache, caches[0], caches[1], slots)
    q_exp = ref.rope_and_write_kv(q, k, v, pos, cache, expected[0], expected[1], slots)
    close(q_rot, q_exp, torch.float16)
    same_fp8(caches[0], expected[0])
    same_fp8(caches[1], expected[1])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("rope", [False, True])  # True: the launch rotates and writes the new key itself
def test_triton_decode_attention_fp8_cache(num_splits, rope):
    """Decode attention over an e4m3 cache (q in fp16) against the reference reading the same cache."""
    gen = torch.Generator().manual_seed(23)
    lens = [1, 50, 16, 33]
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 32, 16, FP8, gen)
    q = torch.randn(len(lens), 8, 32, generator=gen).half()
    new_kv = ref_kv = None
    if rope:
        positions = seq_lens.long() - 1
        slots = torch.tensor([int(bt[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(lens)])
        k, v = (torch.randn(len(lens), 2, 32, generator=gen).half() for _ in range(2))
        cos_sin = ref.rope_cos_sin_cache(32, 64, 10000.0)
        new_kv, ref_kv = (k, v, positions, cos_sin, slots), (k.float(), v.float(), positions, cos_sin, slots)
    caches = (k_cache.clone(), v_cache.clone())
    out = torch.full_like(q, float("nan"))
    TK["attention"].paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out, num_splits=num_splits,
                                           block_n=16, new_kv=new_kv)
    ref_q = q.float()
    if rope:
        ref_q = ref.rope_and_write_kv(ref_q, *ref_kv[:4], *caches, ref_kv[4])
        same_fp8(k_cache, caches[0])
        same_fp8(v_cache, caches[1])
    # attention over the cache the kernel wrote: the interpreter's casts are checked by same_fp8 alone
    close(out, ref.paged_decode_attention(ref_q, k_cache, v_cache, bt, seq_lens), torch.float16)


def test_triton_prefill_and_cascade_attention_fp8_cache():
    gen = torch.Generator().manual_seed(24)
    lens, q_lens = [21, 45, 6, 17], [21, 12, 1, 0]
    k_cache, v_cache, bt, seq_lens = make_paged(lens, 2, 32, 16, FP8, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), 8, 32, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    TK["prefill_attention"].paged_prefill_attention(q, k_cache, v_cache, bt, seq_lens, cu, out=out, block_m=16,
                                                    block_n=16)
    close(out, ref.paged_prefill_attention(q.float(), k_cache, v_cache, bt, seq_lens, cu), torch.float16)
    # rows 0 and 1 share their first block (two samples of one prompt), as the cascade launch reads it once
    bt[1, 0] = bt[0, 0]
    groups = torch.tensor([[0, 2, 16]], dtype=torch.int32)
    prefix_lens = torch.tensor([16, 16, 0, 0], dtype=torch.int32)
    lens = torch.tensor([21, 45, 6, 17], dtype=torch.int32)
    q = torch.randn(4, 8, 32, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    TK["cascade"].cascade_decode_attention(q, k_cache, v_cache, bt, lens, groups, prefix_lens, out=out, block_n=16)
    close(out, ref.paged_decode_attention(q.float(), k_cache, v_cache, bt, lens), torch.float16)
