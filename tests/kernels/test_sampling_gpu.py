"""kernels/sampling.py on CUDA against reference.sample at the 8B shape's vocabulary (bf16 and fp32 logits), and
its split path (kernels/sampling_split.py) against its per-row kernel and the reference.

Marked gpu; skipped without CUDA or under the Triton interpreter. The uniforms are bit-identical on both
sides; log and exp on the GPU may round an ulp away from the CPU's, so a row may differ where its two best
scores (or a top-p mass) lie within rounding of each other: at most one row in a hundred, each such row
a near-tie in the reference's own scores.
"""
import math
import os

import numpy as np
import pytest
import torch
from test_sampling_kernels import records

from pagefleet.kernels import reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="needs CUDA (compiled Triton)")]
V = 128256


def scores(x, rec):
    """The reference's Gumbel scores of one row, without its filters."""
    f = rec.view(torch.float32)
    xs = x.float() * f[ref.INV_TEMPERATURE]
    u = ref.counter_uniform(rec[None, ref.SEED_LO], rec[None, ref.SEED_HI], rec[None, ref.POSITION],
                            torch.arange(V, device=x.device))[0]
    return xs - torch.log(-torch.log(u))


@pytest.mark.parametrize("scale", [3.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampling_kernel_matches_reference(dtype, scale):
    """Peaked (N(0, 9)) and flat (N(0, 0.09)) logits: top-k from the lane-max bound and by count passes (k above
    the 1,024 lanes), top-p gathered at once and narrowed by passes, top-k with top-p, min-p, greedy rows."""
    from pagefleet.kernels import sampling

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 96
    kinds = [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 20, 1.0, 0.05),
             (1.2, 0, 1.0, 0.1), (0.0, 0, 1.0, 0.0), (1.0, 5000, 1.0, 0.0), (1.0, 1, 1.0, 0.0),
             (1.0, 0, 0.5, 0.02), (0.9, 3000, 0.99, 0.0), (1.0, 0, 0.95, 0.0), (0.6, 1000, 1.0, 0.0)]
    temps, top_k, top_p, min_p = (list(c) * (n // len(kinds)) for c in zip(*kinds, strict=True))
    mismatched = 0
    for step in range(3):
        x = (torch.randn(n, V, generator=g, device="cuda") * scale).to(dtype)
        rec = records(temps, top_k, top_p, min_p, seed=np.arange(n) * 7919 - 5, position=step).cuda()
        out = torch.full((n,), -1, dtype=torch.int64, device="cuda")
        got = sampling.sample(x, rec, out.clone(), split=False)
        want = ref.sample(x, rec, out.clone())
        sampled = torch.tensor([t > 0 for t in temps], device="cuda")
        assert (got[~sampled] == -1).all() and (got[sampled] >= 0).all()  # greedy rows left alone
        for i in (got != want).nonzero().flatten().tolist():
            mismatched += 1
            s = scores(x[i], rec[i])
            assert abs(float(s[got[i]] - s[want[i]])) < 1e-3 * max(1.0, abs(float(s[want[i]]))) or \
                top_p[i] < 1.0, (i, int(got[i]), int(want[i]))
    assert mismatched <= math.ceil(0.01 * 3 * n), mismatched


def test_sampling_kernel_draws_are_batch_invariant_on_gpu():
    """A row drawn alone equals the same row drawn among 63 others (same logits, same record), by either path."""
    from pagefleet.kernels import sampling

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, V, generator=g, device="cuda").to(torch.bfloat16)
    rec = records(0.9, 40, 0.9, 0.02, seed=np.arange(64), position=3).cuda()
    for split in (False, True):
        together = sampling.sample(x, rec, split=split)
        for i in (0, 17, 63):
            assert sampling.sample(x[i:i + 1], rec[i:i + 1], split=split)[0] == together[i]


KINDS = [(1.0, 0, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 20, 1.0, 0.05), (1.2, 0, 1.0, 0.1),
         (0.0, 0, 1.0, 0.0), (1.0, 5000, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.5, 0.02), (0.9, 3000, 0.99, 0.0),
         (1.0, 0, 0.95, 0.0), (0.6, 1000, 1.0, 0.0)]  # temperature, top_k, top_p, min_p


@pytest.mark.parametrize("scale", [3.0, 0.3])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_split_path_matches_per_row_kernel_and_reference(rows, scale):
    """The split path against the per-row kernel and the reference at 1, 4 and 16 rows, every kind of row above
    drawn 6 times, peaked and flat bf16 logits: the same token but where a top-p edge lies within the rounding
    of the mass sums (at most one row in a hundred), the same tokens when drawn again (no float atomics)."""
    from pagefleet.kernels import sampling

    g = torch.Generator(device="cuda").manual_seed(rows)
    draws = len(KINDS) * 6
    vs_per_row = vs_ref = 0
    for step in range(draws // rows):
        kinds = [KINDS[(step * rows + i) % len(KINDS)] for i in range(rows)]
        temps, top_k, top_p, min_p = (list(c) for c in zip(*kinds, strict=True))
        x = (torch.randn(rows, V, generator=g, device="cuda") * scale).to(torch.bfloat16)
        rec = records(temps, top_k, top_p, min_p, seed=np.arange(rows) * 7919 + step, position=step).cuda()
        out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
        got = sampling.sample(x, rec, out.clone(), split=True)
        assert torch.equal(sampling.sample(x, rec, out.clone(), split=True), got)
        per_row = sampling.sample(x, rec, out.clone(), split=False)
        want = ref.sample(x, rec, out.clone())
        sampled = torch.tensor([t > 0 for t in temps], device="cuda")
        assert (got[~sampled] == -1).all() and (got[sampled] >= 0).all()  # greedy rows left alone
        for i in (got != per_row).nonzero().flatten().tolist():
            vs_per_row += 1
            assert top_p[i] < 1.0, (i, kinds[i], int(got[i]), int(per_row[i]))  # counts and the draw are exact
        for i in (got != want).nonzero().flatten().tolist():
            vs_ref += 1
            s = scores(x[i], rec[i])
            assert abs(float(s[got[i]] - s[want[i]])) < 1e-3 * max(1.0, abs(float(s[want[i]]))) or \
                top_p[i] < 1.0, (i, kinds[i], int(got[i]), int(want[i]))
    assert vs_per_row <= math.ceil(0.01 * draws) and vs_ref <= math.ceil(0.01 * draws), (vs_per_row, vs_ref)


def test_split_top_p_finishing_program_draws_what_the_rounds_draw():
    """Top-p settled by the finishing program alone (rounds 0: one program repeats the round over its whole row)
    against the split rounds and the reference, flat logits at the 8B vocabulary and small to large top_p."""
    from pagefleet.kernels import reference as ref
    from pagefleet.kernels import sampling_split

    g = torch.Generator(device="cuda").manual_seed(9)
    top_p = [0.1, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.5] * 2
    off = 0
    for step in range(4):
        x = (torch.randn(16, V, generator=g, device="cuda") * 0.3).to(torch.bfloat16)
        rec = records(1.0, 0, top_p, seed=np.arange(16) * 31 + step, position=step).cuda()
        out = torch.full((16,), -1, dtype=torch.int64, device="cuda")
        finished = sampling_split.sample_split(x, rec, out.clone(), rounds=0, top_k=False)
        rounds = sampling_split.sample_split(x, rec, out.clone(), top_k=False)
        want = ref.sample(x, rec, out.clone())
        off += int((finished != rounds).sum()) + int((rounds != want).sum())
    assert off <= 2, off  # only where a top-p edge lies within the rounding of the mass sums


def test_split_path_replays_in_a_cuda_graph():
    """The split path captured once in a CUDA graph (a fixed sequence of launches, no host sync) and replayed
    over new logits and output positions draws what it draws eagerly."""
    from pagefleet.kernels import sampling

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, V, generator=g, device="cuda").to(torch.bfloat16)
    rec = records([1.0, 0.8, 0.0, 1.0], [0, 50, 0, 0], [0.95, 0.95, 1.0, 1.0], [0.0, 0.0, 0.0, 0.05], seed=3).cuda()
    out = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    sampling.sample(x, rec, out, split=True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampling.sample(x, rec, out, split=True)
    for step in range(3):
        x.copy_(torch.randn(4, V, generator=g, device="cuda") * 2)
        rec[:, ref.POSITION] = step
        graph.replay()
        want = sampling.sample(x, rec, torch.full((4,), -1, dtype=torch.int64, device="cuda"), split=True)
        assert torch.equal(out, want) and out[2] == -1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_match_log_softmax_on_gpu(dtype):
    """kernels/logprobs.py at the 8B vocabulary against fp32 log_softmax: every row and picked rows."""
    from pagefleet.kernels import logprobs

    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(256, V, generator=g, device="cuda") * 3).to(dtype)
    tokens = torch.randint(0, V, (256,), generator=g, device="cuda")
    want = ref.token_logprobs(x, tokens)
    torch.testing.assert_close(logprobs.token_logprobs(x, tokens), want, rtol=1e-5, atol=1e-4)
    rows = torch.tensor([255, 3, 100], dtype=torch.int32, device="cuda")
    torch.testing.assert_close(logprobs.token_logprobs(x, tokens, rows), want[rows.long()], rtol=1e-5, atol=1e-4)
