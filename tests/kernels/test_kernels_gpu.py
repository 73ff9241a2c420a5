"""Triton kernels on CUDA in bf16 against their references (fresh random inputs, poisoned outputs).

Marked gpu; skipped where there is no CUDA device (CI) or under the Triton interpreter. Over 300 lines
because it is the one file of kernel tests a GPU machine runs, beside tests/executor/test_engine_gpu.py.
"""
import os

import pytest
import torch
from test_kernels import close

from pagefleet.kernels import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="needs CUDA (compiled Triton)")]
BF = torch.bfloat16


def paged(seq_lens, num_kv_heads, head_dim, block_size):
    nbs = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(nbs) + 5, device="cuda").int()
    bt = torch.full((len(seq_lens), max(nbs) + 1), -1, dtype=torch.int32, device="cuda")
    i = 0
    for s, nb in enumerate(nbs):
        bt[s, :nb] = perm[i: i + nb]
        i += nb
    shape = (len(perm), block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, device="cuda", dtype=BF), torch.randn(shape, device="cuda", dtype=BF), bt,
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 5, 16])
@pytest.mark.parametrize("merge", [True, False])
def test_decode_bf16(block_size, num_splits, merge):
    from pagefleet.kernels import attention

    lens = torch.randint(1, 3000, (24,)).tolist()
    kc, vc, bt, sl = paged(lens, 8, 128, block_size)
    for _ in range(3):  # the in-kernel merge leaves its counters at 0 for the next launch
        q = torch.randn(24, 32, 128, device="cuda", dtype=BF)
        out = torch.full_like(q, float("nan"))
        attention.paged_decode_attention(q, kc, vc, bt, sl, out=out, num_splits=num_splits, merge=merge)
        close(out, ref.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, sl), BF)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (24, 4, 256)])  # Llama-3.1-8B, Qwen3.6-27B
def test_cascade_decode_bf16(heads, kv_heads, head_dim):
    """GRPO's layout at the model shapes: 12 prompts of 100..700 tokens, n = 16 samples each side by side, sharing
    the prompt's whole blocks and each with 1..300 keys of its own, plus 8 rows of their own; groups from
    shared_prefix_groups, against the reference over each row's whole table."""
    from pagefleet.kernels import cascade
    from pagefleet.worker.executor.step_inputs import shared_prefix_groups

    bs, n = 16, 16
    prompts = torch.randint(100, 700, (12,)).tolist()
    lens = [p + int(torch.randint(1, 300, ())) for p in prompts for _ in range(n)]
    lens += torch.randint(1, 900, (8,)).tolist()
    kc, vc, bt, sl = paged(lens, kv_heads, head_dim, bs)
    for i, p in enumerate(prompts):  # the samples take their prompt's whole blocks from the first one's table
        bt[i * n + 1 : (i + 1) * n, : p // bs] = bt[i * n, : p // bs]
    samples = cascade.samples_per_program(heads, kv_heads)
    groups, prefix_lens = shared_prefix_groups(bt.cpu().numpy(), sl.cpu().numpy(), bs, samples)
    assert len(groups) == 12 * n // samples and all(prefix_lens[: 12 * n] > 0) and not prefix_lens[12 * n :].any()
    q = torch.randn(len(lens), heads, head_dim, device="cuda", dtype=BF)
    out = torch.full_like(q, float("nan"))
    cascade.cascade_decode_attention(q, kc, vc, bt, sl, torch.from_numpy(groups).cuda(),
                                     torch.from_numpy(prefix_lens).cuda(), out=out)
    close(out, ref.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, sl), BF)


def test_decode_merge_in_a_graph_at_batch_1():
    """Batch 1, 16 splits merged in the kernel, replayed from a CUDA graph over new queries and lengths."""
    from pagefleet.kernels import attention

    kc, vc, bt, sl = paged([4000], 8, 128, 16)
    q = torch.randn(1, 32, 128, device="cuda", dtype=BF)
    out = torch.empty_like(q)
    attention.paged_decode_attention(q, kc, vc, bt, sl, out=out)  # compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.paged_decode_attention(q, kc, vc, bt, sl, out=out)
    for n in (4000, 1, 1500, 17):
        sl.fill_(n)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        close(out, ref.paged_decode_attention(q.float(), kc.float(), vc.float(), bt, sl), BF)


@pytest.mark.parametrize("batch", [1, 8, 24, 64])  # 16, 4, 2 and 1 splits by default
def test_decode_with_rope_bf16(batch):
    """new_kv=: RoPE (llama3 scaling) and the cache write in the decode launch, against rope_and_write_kv
    followed by the decode attention, at the 8B shape. The values are copied bit for bit; a rotated key may
    differ by one bf16 rounding step (the two kernels' fp32 products can fuse into FMAs differently)."""
    from pagefleet.kernels import attention, rope

    lens = torch.randint(1, 3000, (batch,)).tolist()
    kc, vc, bt, sl = paged(lens, 8, 128, 16)
    positions = sl.long() - 1
    slots = torch.stack([bt[b, p // 16].long() * 16 + p % 16 for b, p in enumerate(positions)])
    slots[batch // 2] = -1  # a padding row writes nothing
    cos_sin = ref.rope_cos_sin_cache(128, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, device="cuda")
    qkv = torch.randn(batch, 48 * 128, device="cuda", dtype=BF)
    q, k, v = (t.view(batch, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    caches = (kc.clone(), vc.clone())
    q_rot = rope.rope_and_write_kv(q, k, v, positions, cos_sin, *caches, slots)
    expected = attention.paged_decode_attention(q_rot, *caches, bt, sl)
    out = torch.full_like(q, float("nan"))
    attention.paged_decode_attention(q, kc, vc, bt, sl, out=out, new_kv=(k, v, positions, cos_sin, slots))
    assert torch.equal(vc, caches[1])
    written = slots[slots >= 0]
    got_k, want_k = (c.flatten(0, 1)[written].float() for c in (kc, caches[0]))
    assert ((got_k - want_k).abs() <= want_k.abs() * 2**-7).all()  # within one bf16 step
    others = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device="cuda")
    others[written] = False
    assert torch.equal(kc.flatten(0, 1)[others], caches[0].flatten(0, 1)[others])  # nothing else written
    close(out, expected, BF)
    close(out, ref.paged_decode_attention(q.float(), *(c.float() for c in caches), bt, sl,
                                          new_kv=(k.float(), v.float(), positions, cos_sin, slots)), BF)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_bf16(group):
    from pagefleet.kernels import prefill_attention

    q_lens, prefixes = [700, 300, 1, 1, 0], [0, 900, 40, 2000, 5]
    kc, vc, bt, sl = paged([a + b for a, b in zip(q_lens, prefixes, strict=True)], 8, 128, 16)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 8 * group, 128, device="cuda", dtype=BF)
    out = torch.full_like(q, float("nan"))
    prefill_attention.paged_prefill_attention(q, kc, vc, bt, sl, cu, out=out)
    close(out, ref.paged_prefill_attention(q.float(), kc.float(), vc.float(), bt, sl, cu), BF)


def test_prefill_padded_as_a_prompt_graph_stages_it():
    """worker/executor/graphs/prompt.py pads a step to its token bucket and to 4 sequences: padding sequences own no
    tokens and no keys, padding tokens belong to no sequence. The real rows match the reference; the
    spare tiles exit without writing, so the padding rows keep their poison."""
    from pagefleet.kernels import prefill_attention

    q_lens, prefixes = [300, 21], [0, 40]
    kc, vc, bt, sl = paged([a + b for a, b in zip(q_lens, prefixes, strict=True)], 8, 128, 16)
    bt = torch.cat([bt, torch.zeros(2, bt.shape[1], dtype=torch.int32, device="cuda")])  # padding sequences
    sl = torch.cat([sl, torch.zeros(2, dtype=torch.int32, device="cuda")])
    real = sum(q_lens)
    cu = torch.tensor([0, 300, real, real, real], dtype=torch.int32, device="cuda")
    q = torch.randn(384, 32, 128, device="cuda", dtype=BF)  # the 384-token bucket
    out = torch.full_like(q, float("nan"))
    prefill_attention.paged_prefill_attention(q, kc, vc, bt, sl, cu, out=out)
    close(out[:real], ref.paged_prefill_attention(q[:real].float(), kc.float(), vc.float(), bt[:2], sl[:2], cu[:3]), BF)
    assert out[real:].isnan().all()


def test_small_kernels_bf16():
    from pagefleet.kernels import activation, fp8, kv_cache, norm, rope

    T = 777
    kc, vc = (torch.randn(100, 16, 8, 128, device="cuda", dtype=BF) for _ in range(2))
    k, v = torch.randn(T, 8, 128, device="cuda", dtype=BF), torch.randn(T, 8, 128, device="cuda", dtype=BF)
    slots = torch.randperm(1600, device="cuda")[:T]
    slots[::7] = -1
    kr, vr = kc.clone(), vc.clone()
    kv_cache.write_kv_cache(k, v, kc, vc, slots)
    ref.write_kv_cache(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    x, r, w = (torch.randn(T, 4096, device="cuda", dtype=BF) for _ in range(3))
    w = w[0]
    close(norm.rms_norm(x, w), ref.rms_norm(x, w), BF)
    n, res = norm.fused_add_rms_norm(x, r, w)
    assert torch.equal(res, x + r)
    close(n, ref.rms_norm(x + r, w), BF)
    cache = ref.rope_cos_sin_cache(128, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, device="cuda")
    qh = torch.randn(T, 32, 128, device="cuda", dtype=BF)
    pos = torch.randint(0, 4096, (T,), device="cuda")
    for got, exp in zip(rope.apply_rope(qh, k, pos, cache), ref.apply_rope(qh, k, pos, cache), strict=True):
        close(got, exp, BF)
    xm = torch.randn(T, 2 * 1000, device="cuda", dtype=BF)
    close(activation.silu_and_mul(xm), ref.silu_and_mul(xm), BF)
    q8, s8 = fp8.quantize_fp8_per_token(x)
    q8r, s8r = ref.quantize_fp8_per_token(x)
    assert torch.allclose(s8, s8r) and (q8.float() != q8r.float()).float().mean() < 1e-4
    w8, ws = ref.quantize_weight_fp8(torch.randn(512, 4096, device="cuda", dtype=BF))
    close(fp8.fp8_linear(x, w8, ws), ref.fp8_linear(x, w8, ws), BF)


def test_fp8_quantising_norms_and_activation_bf16():
    """rms_norm_fp8, fused_add_rms_norm_fp8 and silu_and_mul_fp8 on the 8B shape: bit for bit the plain
    kernel's output through quantize_fp8_per_token (rows of very different sizes), and fp8_gemm on their
    rows the same as fp8_linear on the plain output."""
    from pagefleet.kernels import activation, fp8, norm

    def same(got, expected):
        (q, scale), (q_ref, scale_ref) = got, expected
        assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and scale.shape == scale_ref.shape
        assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

    T = 777
    sizes = torch.logspace(-2, 2, T, device="cuda")[:, None]
    x, r = (torch.randn(T, 4096, device="cuda") * sizes).to(BF), torch.randn(T, 4096, device="cuda", dtype=BF)
    w = torch.randn(4096, device="cuda", dtype=BF)
    same(norm.rms_norm_fp8(x, w), fp8.quantize_fp8_per_token(norm.rms_norm(x, w)))
    q, scale, res = norm.fused_add_rms_norm_fp8(x, r, w)
    normed, res_ref = norm.fused_add_rms_norm(x, r, w)
    same((q, scale), fp8.quantize_fp8_per_token(normed))
    assert torch.equal(res, res_ref)
    w8, ws = ref.quantize_weight_fp8(torch.randn(512, 4096, device="cuda", dtype=BF))
    assert torch.equal(fp8.fp8_gemm(q, scale, w8, ws), fp8.fp8_linear(normed, w8, ws))
    xm = (torch.randn(T, 2 * 14336, device="cuda") * sizes * 3).to(BF)
    same(activation.silu_and_mul_fp8(xm), fp8.quantize_fp8_per_token(activation.silu_and_mul(xm)))
    q, scale = norm.rms_norm_fp8(x[:0], w)  # an empty step launches nothing
    assert q.shape == (0, 4096) and scale.shape == (0, 1)


LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                    "lm_head": (128256, 4096)}  # name: (N, K)


@pytest.mark.parametrize("shape", list(LLAMA_8B_LINEARS))
@pytest.mark.parametrize("M", [1, 2, 8, 16, 24, 32])  # 24, 32: ops.SKINNY_MAX_ROWS raised to 32 (test_engine_gpu.py)
def test_skinny_matmul_bf16(shape, M):
    from pagefleet.kernels import gemv

    N, K = LLAMA_8B_LINEARS[shape]
    x = torch.randn(M, K, device="cuda", dtype=BF)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(BF)
    bias = torch.randn(N, device="cuda", dtype=BF)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=BF)
    gemv.skinny_matmul(x, w, bias, out=out)
    close(out, ref.skinny_matmul(x.float(), w.float(), bias.float()), BF)
    close(gemv.skinny_matmul(x, w, split_k=2), ref.skinny_matmul(x.float(), w.float()), BF)


@pytest.mark.parametrize("shape", ["qkv", "o_proj", "gate_up", "down"])
@pytest.mark.parametrize("M", [1, 8, 16, 32])  # FP8 graphs use the GEMV up to 32 rows
def test_skinny_matmul_fp8_weight(shape, M):
    """Weight-only FP8 at Llama-3.1-8B's decoder shapes: e4m3 weights with per-row scales (models/layers/fp8.py),
    bf16 x; against the bf16-rounded product over the dequantised weight. Plain, gated for gate_up, and
    the folded-norm options."""
    from pagefleet.kernels import gemv

    N, K = LLAMA_8B_LINEARS[shape]
    x = torch.randn(M, K, device="cuda", dtype=BF)
    w8, scale = ref.quantize_weight_fp8((torch.randn(N, K, device="cuda") / K**0.5).to(BF))
    dequant = w8.float() * scale[:, None]
    bias = torch.randn(N, device="cuda", dtype=BF)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=BF)
    gemv.skinny_matmul(x, w8, bias, out=out, weight_scale=scale)
    close(out, ref.skinny_matmul(x.float(), dequant, bias.float()), BF)
    if shape == "gate_up":
        close(gemv.skinny_matmul(x, w8, gated=True, weight_scale=scale),
              ref.skinny_matmul(x.float(), dequant, gated=True), BF)
    if shape in ("o_proj", "down"):
        residual = torch.randn(M, N, device="cuda", dtype=BF)
        h, sumsq = gemv.skinny_matmul(x, w8, residual=residual, weight_scale=scale)
        close(h, ref.skinny_matmul(x.float(), dequant, residual=residual.float())[0], BF)
        close(sumsq.sum(0), h.float().square().sum(-1), torch.float32)
    if shape in ("qkv", "gate_up"):  # a folded norm's input is normalised before the fp16 dot: an outlier past
        h = x.clone()                # fp16's range (65504) in the residual stream stays finite and exact
        h[0, 0] = 1e6
        gated = shape == "gate_up"
        got = gemv.skinny_matmul(h, w8, sumsq=h.float().square().sum(-1)[None], eps=1e-5, weight_scale=scale,
                                 gated=gated)
        normed = ref.rms_norm(h.float(), torch.ones(K, device="cuda"), 1e-5)
        close(got, ref.skinny_matmul(normed, dequant, gated=gated), BF)


@pytest.mark.parametrize("fp8", [False, True])
def test_split_gemvs_in_a_graph(fp8):
    """The default configs split K for down (bf16) and for qkv, o_proj and down (FP8): those GEMVs, as the
    folded decode layer calls them, captured in one CUDA graph and replayed over new inputs, each replay
    merging through counters that the previous one left at 0."""
    from pagefleet.kernels import arrivals, gemv

    H, inter = LLAMA_8B_LINEARS["o_proj"][0], LLAMA_8B_LINEARS["down"][1]
    ws = {name: (torch.randn(*LLAMA_8B_LINEARS[name], device="cuda") / LLAMA_8B_LINEARS[name][1] ** 0.5).to(BF)
          for name in ("qkv", "o_proj", "down")}
    if fp8:
        assert all(gemv.default_config(1, *LLAMA_8B_LINEARS[n], 132, 1)[-1] > 1 for n in ws)
        ws = {name: ref.quantize_weight_fp8(w) for name, w in ws.items()}
    else:
        assert gemv.default_config(1, *LLAMA_8B_LINEARS["down"])[-1] > 1
        ws = {name: (w, None) for name, w in ws.items()}
    dense = {name: w.float() * (1 if s is None else s[:, None]) for name, (w, s) in ws.items()}
    x, act, residual = (torch.empty(8, k, device="cuda", dtype=BF) for k in (H, inter, H))
    sumsq = torch.empty(1, 8, device="cuda")
    arrivals.reserve("cuda")

    def layer():
        qkv = gemv.skinny_matmul(x, ws["qkv"][0], sumsq=sumsq, eps=1e-5, weight_scale=ws["qkv"][1])
        h, _ = gemv.skinny_matmul(x, ws["o_proj"][0], residual=residual, weight_scale=ws["o_proj"][1])
        out, _ = gemv.skinny_matmul(act, ws["down"][0], residual=h, weight_scale=ws["down"][1])
        return qkv, h, out

    layer()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for _ in range(3):
        for t in (x, act, residual):
            t.copy_(torch.randn_like(t))
        sumsq.copy_(x.float().square().sum(-1)[None])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        close(outs[0], ref.skinny_matmul(ref.rms_norm(x.float(), torch.ones(H, device="cuda"), 1e-5), dense["qkv"]), BF)
        h = ref.skinny_matmul(x.float(), dense["o_proj"], residual=residual.float())[0]
        close(outs[1], h, BF)
        close(outs[2], ref.skinny_matmul(act.float(), dense["down"], residual=outs[1].float())[0], BF)
    assert not arrivals.counters(torch.device("cuda"), 0).any()


@pytest.mark.parametrize("M", [1, 16, 32])
def test_embed_rows_bf16(M):
    """A folded decode step's embeddings (Llama-3.1-8B's 128256 x 4096 table) and their sums of squares."""
    from pagefleet.kernels import norm

    table = torch.randn(128256, 4096, device="cuda", dtype=BF)
    ids = torch.randint(0, 128256, (M,), device="cuda")
    ids[0] = 128255
    rows, sumsq = norm.embed_rows(ids, table)
    exp_rows, exp_sumsq = ref.embed_rows(ids, table)
    assert torch.equal(rows, exp_rows)
    close(sumsq, exp_sumsq, torch.float32)


@pytest.mark.parametrize("M", [1, 4, 16])
def test_folded_norm_gemvs_bf16(M):
    """Llama-3.1-8B's o_proj adding into the stream, then gate_up reading it through a folded RMSNorm
    (LlamaForCausalLM.forward_folded), against the references of the unfolded layer."""
    from pagefleet.kernels import gemv

    H, inter = LLAMA_8B_LINEARS["o_proj"][0], LLAMA_8B_LINEARS["gate_up"][0] // 2
    x, residual = torch.randn(M, H, device="cuda", dtype=BF), torch.randn(M, H, device="cuda", dtype=BF)
    wo = (torch.randn(H, H, device="cuda") / H**0.5).to(BF)
    h, sumsq = gemv.skinny_matmul(x, wo, residual=residual)
    close(h, ref.skinny_matmul(x.float(), wo.float(), residual=residual.float())[0], BF)
    close(sumsq.sum(0), h.float().square().sum(-1), torch.float32)
    g = 1 + 0.2 * torch.randn(H, device="cuda")
    w_gu = torch.randn(2 * inter, H, device="cuda") / H**0.5
    got = gemv.skinny_matmul(h, (w_gu * g).to(BF), sumsq=sumsq, eps=1e-5, gated=True)
    close(got, ref.skinny_matmul(ref.rms_norm(h.float(), g, 1e-5), w_gu, gated=True), BF)


@pytest.mark.parametrize("M", [1, 4, 16])
def test_gated_skinny_matmul_bf16(M):
    """Llama-3.1-8B's gate_up with the activation fused: against the reference, and the same bits as
    the GEMV followed by the silu-and-mul kernel."""
    from pagefleet.kernels import activation, gemv

    N, K = LLAMA_8B_LINEARS["gate_up"]
    x = torch.randn(M, K, device="cuda", dtype=BF)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(BF)
    out = torch.full((M, N // 2), float("nan"), device="cuda", dtype=BF)
    gemv.skinny_matmul(x, w, out=out, gated=True)
    close(out, ref.skinny_matmul(x.float(), w.float(), gated=True), BF)
    assert torch.equal(out, activation.silu_and_mul(gemv.skinny_matmul(x, w)))


def test_rope_and_write_kv_bf16():
    """8B shape (32 q heads, 8 KV heads, 128 dims, llama3 scaling), k/v as views of a fused qkv, some
    padding slots: the same bits as apply_rope and then write_kv_cache."""
    from pagefleet.kernels import kv_cache, rope

    T = 37
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cache = ref.rope_cos_sin_cache(128, 8192, 500000.0, scaling, torch.float32, "cuda")
    qkv = torch.randn(T, 48 * 128, device="cuda", dtype=BF)
    q, k, v = qkv[:, :4096].view(T, 32, 128), qkv[:, 4096:5120].view(T, 8, 128), qkv[:, 5120:].view(T, 8, 128)
    pos = torch.randint(0, 8192, (T,), device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:T]
    slots[::5] = -1
    kc, vc = (torch.randn(64, 16, 8, 128, device="cuda", dtype=BF) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot = rope.rope_and_write_kv(q, k, v, pos, cache, kc, vc, slots)
    q_two, k_two = rope.apply_rope(q, k, pos, cache)
    kv_cache.write_kv_cache(k_two, v, kc2, vc2, slots)
    assert torch.equal(q_rot, q_two) and torch.equal(kc, kc2) and torch.equal(vc, vc2)



@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_argmax_matches_torch(rows, dtype):
    """Llama-3's vocabulary in bf16 (the greedy path) and fp32 (the sampled path); bf16 logits tie often."""
    from pagefleet.kernels import greedy

    for _ in range(3):  # the per-row counters are back at 0 after each launch
        x = torch.randn(rows, 128256, device="cuda").to(dtype)
        x[0, [5, 128255]] = 50.0  # a tie across chunks
        assert torch.equal(greedy.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("M", [33, 64, 128])
def test_fp8_skinny_gemm_8b_shapes_in_a_graph(M):
    """kernels/fp8_skinny.py at the 8B decoder shapes with its default configs (K split where they split),
    all four captured in one CUDA graph and replayed over new quantised rows, each replay merging through
    counters the previous one left at 0; against the fp32 product of the dequantised operands."""
    from pagefleet.kernels import arrivals, fp8_skinny

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    shapes = {name: LLAMA_8B_LINEARS[name] for name in ("qkv", "o_proj", "gate_up", "down")}
    ws = {name: ref.quantize_weight_fp8((torch.randn(N, K, device="cuda") / K**0.5).to(BF))
          for name, (N, K) in shapes.items()}
    xs = {name: ref.quantize_fp8_per_token(torch.randn(M, K, device="cuda", dtype=BF))
          for name, (_, K) in shapes.items()}
    bias = torch.randn(shapes["qkv"][0], device="cuda", dtype=BF)
    arrivals.reserve("cuda")

    def run():
        return {name: fp8_skinny.fp8_skinny_gemm(*xs[name], *ws[name], bias if name == "qkv" else None)
                for name in shapes}

    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(2):
        for q, scale in xs.values():
            new_q, new_scale = ref.quantize_fp8_per_token(torch.randn(M, q.shape[1], device="cuda", dtype=BF))
            q.copy_(new_q)
            scale.copy_(new_scale)
        for o in outs.values():
            o.fill_(float("nan"))
        graph.replay()
        for name, out in outs.items():
            close(out, ref.fp8_gemm(*xs[name], *ws[name], bias if name == "qkv" else None, torch.float32), BF)
    assert not arrivals.counters("cuda", 0).any()


# ---------------------------------------------------------------- fp8 KV cache (--kv-cache-dtype fp8)

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (24, 4, 256)])  # Llama-3.1-8B, Qwen3.6-27B
def test_fp8_kv_cache_writes_and_attention(heads, kv_heads, head_dim):
    """An e4m3 cache: every writer (write_kv_cache, rope_and_write_kv, the decode launch's own write) stores what
    torch's cast of the model-dtype value stores, bit for bit, saturated at +-448; decode, prefill and cascade
    attention over it match the reference reading the same cache."""
    from pagefleet.kernels import attention, cascade, kv_cache, prefill_attention, rope

    T = 37
    k, v = (torch.randn(T, kv_heads, head_dim, device="cuda", dtype=BF) * 30 for _ in range(2))
    k[1, 0, :2] = torch.tensor([1000.0, -600.0], dtype=BF)  # token 1: slots[::5] leaves token 0 unwritten
    slots = torch.randperm(64 * 16, device="cuda")[:T]
    slots[::5] = -1
    kc, vc = (torch.zeros(64, 16, kv_heads, head_dim, device="cuda", dtype=FP8) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    kv_cache.write_kv_cache(k, v, kc, vc, slots)
    ref.write_kv_cache(k, v, kc2, vc2, slots)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8)) and torch.equal(vc.view(torch.uint8),
                                                                                    vc2.view(torch.uint8))
    assert torch.isfinite(kc.float()).all() and kc.float().abs().max() == 448.0

    # the 27B shape rotates a quarter of each head (partial_rotary_factor 0.25), the rest is copied
    cos_sin = ref.rope_cos_sin_cache(head_dim // 4 if head_dim == 256 else head_dim, 8192, 500000.0, None,
                                     torch.float32, "cuda")
    q = torch.randn(T, heads, head_dim, device="cuda", dtype=BF)
    pos = torch.randint(0, 8192, (T,), device="cuda")
    kc3, vc3 = kc.clone(), vc.clone()
    rope.rope_and_write_kv(q, k, v, pos, cos_sin, kc, vc, slots)
    _, k_rot = ref.apply_rope(q, k, pos, cos_sin)
    ref.write_kv_cache(k_rot, v, kc3, vc3, slots)
    kf, kf3 = kc.float(), kc3.float()
    # a rotated key may differ by one bf16 step before its cast (FMA contraction), so one e4m3 step after it
    assert ((kf - kf3).abs() <= kf3.abs() / 8 + 2**-9).all()
    assert torch.equal(vc.view(torch.uint8), vc3.view(torch.uint8))

    lens = torch.randint(1, 3000, (24,)).tolist()
    kc, vc, bt, sl = paged(lens, kv_heads, head_dim, 16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    qd = torch.randn(24, heads, head_dim, device="cuda", dtype=BF)
    for splits in (None, 1, 5):
        out = torch.full_like(qd, float("nan"))
        attention.paged_decode_attention(qd, kc, vc, bt, sl, out=out, num_splits=splits)
        close(out, ref.paged_decode_attention(qd.float(), kc, vc, bt, sl), BF)
    # the decode launch's own RoPE and write (batch below ROPE_MAX_BATCH)
    positions = sl.long() - 1
    wslots = torch.stack([bt[b, p // 16].long() * 16 + p % 16 for b, p in enumerate(positions)])
    kn, vn = (torch.randn(24, kv_heads, head_dim, device="cuda", dtype=BF) for _ in range(2))
    caches = (kc.clone(), vc.clone())
    q_rot = rope.rope_and_write_kv(qd, kn, vn, positions, cos_sin, *caches, wslots)
    out = torch.full_like(qd, float("nan"))
    attention.paged_decode_attention(qd, kc, vc, bt, sl, out=out, new_kv=(kn, vn, positions, cos_sin, wslots))
    assert torch.equal(vc.view(torch.uint8), caches[1].view(torch.uint8))
    assert ((kc.float() - caches[0].float()).abs() <= caches[0].float().abs() / 8 + 2**-9).all()
    close(out, ref.paged_decode_attention(q_rot.float(), kc, vc, bt, sl), BF)

    q_lens, prefixes = [700, 300, 1, 1, 0], [0, 900, 40, 2000, 5]
    kc, vc, bt, sl = paged([a + b for a, b in zip(q_lens, prefixes, strict=True)], kv_heads, head_dim, 16)
    kc, vc = kc.to(FP8), vc.to(FP8)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=BF)
    out = torch.full_like(qp, float("nan"))
    prefill_attention.paged_prefill_attention(qp, kc, vc, bt, sl, cu, out=out)
    close(out, ref.paged_prefill_attention(qp.float(), kc, vc, bt, sl, cu), BF)
    # rows 0 and 1 share their first two blocks: the cascade launch reads them once for both
    bt[1, :2] = bt[0, :2]
    groups = torch.tensor([[0, 2, 32]], dtype=torch.int32, device="cuda")
    prefix_lens = torch.tensor([32, 32, 0, 0, 0], dtype=torch.int32, device="cuda")
    qc = torch.randn(5, heads, head_dim, device="cuda", dtype=BF)
    out = cascade.cascade_decode_attention(qc, kc, vc, bt, sl, groups, prefix_lens)
    close(out, ref.paged_decode_attention(qc.float(), kc, vc, bt, sl), BF)
