"""kernels/sampling.py against reference.sample under the Triton interpreter: the same token for the same record.

Runs only with TRITON_INTERPRET=1 set before Python starts: test_sampling_kernels.py launches it that way in a
child process. Directly: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_sampling_triton.py
"""
import math
import os

import numpy as np
import pytest
import torch
from test_sampling_kernels import records

from pagefleet.kernels import reference as ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests: run by test_sampling_kernels.py in a child process")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.importorskip("triton")
    from pagefleet.kernels import logprobs, sampling


def both(x, rec, **blocks):
    """The per-row kernel (a 32-entry candidate buffer unless told: brackets overflow it and are narrowed by count
    passes; never the split path these few rows would take by default) and the reference on the same rows."""
    out = torch.full((x.shape[0],), -5, dtype=torch.int64)
    got = sampling.sample(x, rec, out.clone(), **{"cap": 32, "split": False, **blocks})
    want = ref.sample(x, rec, out.clone())
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_sample_matches_reference(dtype):
    """Every filter alone and together, greedy rows left alone, seeds with their high word set, a partial tail
    block (V = 333 over blocks of 64 and searches of 32): the same token on every row, over three positions."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(10, 333, generator=g) * 2.5).to(dtype)
    temps = [1.0, 0.7, 1.3, 0.0, 1.0, 0.5, 2.0, 1.0, 0.9, 1.0]
    top_k = [0, 5, 40, 0, 3, 0, 1, 332, 20, 0]
    top_p = [1.0, 1.0, 0.8, 1.0, 0.5, 0.95, 1.0, 0.3, 0.6, 1.0]
    min_p = [0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0, 0.0, 0.02, 0.3]
    seeds = [1, 2, -3, 4, 2**63 + 5, 7, 2**40, 0, 99, 12345]
    for step in range(3):
        rec = records(temps, top_k, top_p, min_p, seeds, [step, 3 + step, 9, 1, 2, 5, 0, 7, 8, 2 ** 20 + step])
        got, want = both(x, rec, block=64, search_block=32)
        assert torch.equal(got, want), (got, want)
        assert got[3] == -5 and (got[[0, 1, 2, 4, 5, 6, 7, 8, 9]] >= 0).all()


def test_triton_sample_thresholds_on_ties():
    """Ties at the top-k and the top-p threshold, across search blocks: the kernel keeps the same set as the
    reference (every tied token drawn), and -inf logits (banned tokens) are never drawn."""
    n = 48  # P(one of four equally likely tokens never drawn) = 4 * 0.75**48 < 1e-5
    x = torch.full((n, 96), -2.0)
    x[:, [3, 40, 41, 90]] = 4.0  # four tied at the top, in different blocks
    x[:, 50] = float("-inf")
    for top_k, top_p in ((2, 1.0), (0, 0.3), (3, 0.5)):
        rec = records(1.0, top_k, top_p, seed=8, position=np.arange(n))
        got, want = both(x, rec, block=32, search_block=16)
        assert torch.equal(got, want)
        assert set(got.tolist()) == {3, 40, 41, 90}
    y = torch.tensor([[0.0, math.log(0.25), -3.0, float("-inf")]]).repeat(n, 1)
    got, want = both(y, records(1.0, min_p=0.25, seed=5, position=np.arange(n)), block=16, search_block=16)
    assert torch.equal(got, want) and set(got.tolist()) == {0, 1}


def test_triton_sample_many_rows_one_launch():
    """Rows of one launch do not disturb each other: each row equals itself drawn alone."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 200, generator=g)
    rec = records([1.0, 0.8, 1.0, 1.1, 0.6, 1.0], [0, 10, 0, 4, 0, 0], [0.9, 1.0, 0.7, 1.0, 1.0, 0.99],
                  seed=[5, 5, 6, 6, 7, 7], position=[0, 1, 0, 1, 0, 1])
    blocks = dict(block=64, search_block=64, cap=64, split=False)
    together = sampling.sample(x, rec, **blocks)
    for i in range(6):
        assert sampling.sample(x[i:i + 1], rec[i:i + 1], **blocks)[0] == together[i]


def test_triton_sample_every_path_to_a_threshold():
    """Each way the kernel finds a threshold, against the reference: top-k from the lane-max bound gathered at
    once; that bound too loose for the buffer (the top tokens in one lane); k above the lanes (count passes from
    the bottom); top-p over flat logits (a bracket narrowed several times) and over peaked ones; a tie group
    larger than the buffer straddling each threshold (a bracket of one key); the same tokens whatever the
    buffer's size."""
    g = torch.Generator().manual_seed(9)
    V = 256
    peaked = torch.randn(V, generator=g) * 4
    flat = torch.randn(V, generator=g) * 0.05
    one_lane = torch.randn(V, generator=g)
    one_lane[::32] += 10.0  # with block 32, the eight largest share lane 0: the 3rd lane max is far below
    tied = torch.randn(V, generator=g)
    tied[40:120] = 3.0  # 80 tied at the top
    rows = torch.stack([peaked, one_lane, peaked, flat, peaked, tied, tied, flat, one_lane])
    top_k = [3, 3, 100, 0, 0, 5, 0, 40, 6]
    top_p = [1.0, 1.0, 1.0, 0.9, 0.6, 1.0, 0.2, 0.5, 0.7]
    for step in range(2):
        rec = records(1.0, top_k, top_p, seed=[11, 12, 13, 14, 15, 16, 17, 18, 19], position=step)
        want = None
        for cap, fold in ((8, 1), (32, 1), (256, 1), (8, 4), (32, 2)):  # fold: count passes read 2 or 4 blocks a step
            got, want = both(rows, rec, block=32, search_block=16, cap=cap, fold=fold)
            assert torch.equal(got, want), (cap, fold, got, want)
        got, want = both(rows[:, :250].contiguous(), rec, block=32, search_block=16, cap=8, fold=4)  # a ragged tail
        assert torch.equal(got, want), (got, want)
    assert all(40 <= t < 120 for t in want[[5, 6]].tolist())


def test_triton_sample_edge_settings():
    """top_k 1 is greedy; top_k >= V and top_p 1 are off; a row of -inf but one token draws that token under
    every filter; min-p with top-p; fp32 and bf16 rows of different settings in one batch."""
    g = torch.Generator().manual_seed(3)
    V = 200
    x = torch.randn(6, V, generator=g) * 2
    n = x.shape[0]
    for step in range(2):
        got, want = both(x, records(0.7, 1, 1.0, seed=np.arange(n), position=step), block=64, search_block=32)
        assert torch.equal(got, want) and torch.equal(got, x.argmax(dim=1))
        off = both(x, records(1.0, 0, 1.0, seed=np.arange(n), position=step), block=64)[0]
        for k in (V, V + 7):
            got, want = both(x, records(1.0, k, 1.0, seed=np.arange(n), position=step), block=64, search_block=32)
            assert torch.equal(got, want) and torch.equal(got, off)
    lone = torch.full((4, V), float("-inf"))
    lone[torch.arange(4), torch.tensor([0, 77, 150, V - 1])] = torch.tensor([-30.0, 0.0, 12.0, 1.0])
    rec = records([1.0, 0.5, 1.0, 2.0], [0, 3, 1, 0], [0.9, 0.5, 1.0, 0.3], [0.0, 0.1, 0.0, 0.5], seed=[1, 2, 3, 4])
    got, want = both(lone, rec, block=64, search_block=32)
    assert got.tolist() == want.tolist() == [0, 77, 150, V - 1]
    for dtype in (torch.float32, torch.bfloat16):
        y = (torch.randn(8, V, generator=g) * 3).to(dtype)
        rec = records([1.0, 0.8, 1.2, 1.0, 0.9, 1.0, 0.6, 1.0], [0, 0, 10, 0, 50, 2, 0, 0],
                      [0.9, 0.95, 0.8, 1.0, 0.9, 1.0, 0.5, 0.99], [0.1, 0.02, 0.05, 0.2, 0.0, 0.0, 0.3, 0.01],
                      seed=np.arange(8) + 40, position=5)
        got, want = both(y, rec, block=64, search_block=32)
        assert torch.equal(got, want), (dtype, got, want)


def test_triton_sample_full_row_draw_across_lanes_and_blocks():
    """The draw over the whole row (temperature alone: no filter gathers a buffer) keeps a best per lane and
    reduces once: the same token as the reference over many positions and a partial tail block, and a tie (two
    +inf logits in different lanes and blocks: both score +inf) goes to the lowest id, as in the reference."""
    g = torch.Generator().manual_seed(31)
    x = torch.randn(12, 333, generator=g) * 3
    x[11] = -1.0
    x[11, [200, 17]] = float("inf")
    for step in range(4):
        rec = records([1.0, 0.7, 1.5] * 4, 0, 1.0, seed=np.arange(12) + 3, position=step * 5 + np.arange(12))
        got, want = both(x, rec, block=64)
        assert torch.equal(got, want), (step, got, want)
        assert got[11] == 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_token_logprobs_match_log_softmax(dtype):
    """kernels/logprobs.py against the reference (fp32 log_softmax, then the token): every row or picked rows,
    a partial tail block (333 over blocks of 64), -inf logits beside the chosen token, a row of one live token."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 333, generator=g) * 4).to(dtype)
    x[2, ::3] = float("-inf")
    x[5, :] = float("-inf")
    x[5, 300] = 2.0
    tokens = torch.tensor([0, 332, 1, 64, 128, 300, 200])
    got = logprobs.token_logprobs(x, tokens, block=64)
    want = ref.token_logprobs(x, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert got[5] == 0.0
    rows = torch.tensor([6, 2, 5], dtype=torch.int32)
    torch.testing.assert_close(logprobs.token_logprobs(x, tokens, rows, block=64), want[rows.long()], rtol=0,
                               atol=2e-6)
    assert logprobs.token_logprobs(x, tokens, rows[:0], block=64).shape == (0,)


def split_rows(V):
    """Rows of V logits, one per case below: each filter alone and together, greedy rows, ties at a threshold
    across chunks, a row of -inf but one token, banned tokens, flat logits (top-p's edge far down the row)."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(16, V, generator=g) * 2.5
    x[3] = torch.randn(V, generator=g) * 0.05  # flat
    x[7, :] = -1.0
    x[7, [5, 150, 151, V - 1]] = 3.0  # four tied at the top, in every chunk (the last one partial)
    x[8] = x[7]
    x[9, :] = float("-inf")
    x[9, 100] = 0.5  # all -inf but one
    x[10, ::7] = float("-inf")  # banned tokens among live ones
    cases = [  # temperature, top_k, top_p, min_p
        (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 40, 0.8, 0.05), (1.0, 0, 0.9, 0.0),
        (0.0, 0, 1.0, 0.0), (1.0, 3, 0.5, 0.1), (2.0, 1, 1.0, 0.0), (1.0, 2, 1.0, 0.0),
        (1.0, 0, 0.3, 0.0), (0.5, 3, 0.9, 0.2), (0.9, 20, 0.6, 0.02), (1.0, 0, 1.0, 0.3),
        (0.0, 7, 0.5, 0.0), (1.0, V - 1, 0.95, 0.0), (0.8, 50, 0.95, 0.0), (1.0, 0, 0.99, 0.01),
    ]
    return x, [list(c) for c in zip(*cases, strict=True)]


@pytest.mark.parametrize("dtype, step", [(torch.float32, 0), (torch.bfloat16, 1)])
def test_triton_split_matches_per_row_and_reference(dtype, step):
    """The split path (R * ceil(V / chunk) programs, V = 333 over chunks of 128: a partial last chunk) against
    the per-row kernel and the reference, token for token: every filter and their combinations, ties at the
    top-k and top-p thresholds across chunks, a row of -inf but one, banned tokens, greedy rows left alone."""
    V = 333
    x, (temps, top_k, top_p, min_p) = split_rows(V)
    x = x.to(dtype)
    rec = records(temps, top_k, top_p, min_p, seed=np.arange(16) * 31 - 4, position=np.arange(16) + step * 5)
    out = torch.full((16,), -5, dtype=torch.int64)
    got = sampling.sample(x, rec, out.clone(), split=True, chunk=128)
    per_row = sampling.sample(x, rec, out.clone(), split=False, block=64, search_block=32, cap=32)
    want = ref.sample(x, rec, out.clone())
    assert torch.equal(got, want) and torch.equal(per_row, want), (got, per_row, want)
    assert got[4] == got[12] == -5 and got[9] == 100 and got[7] in (5, 150, 151, V - 1) and got[10] % 7 != 0


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_triton_split_top_p_rejection_settles_in_rounds_or_its_finishing_program(rounds):
    """Top-p by rejection over flat logits and small top_p, where the race's first winner usually falls outside
    the nucleus: the rows settle in the split rounds or, with rounds 0 or 1, mostly in the finishing program that
    repeats the round over the whole row; every row draws the reference's token, with top-k and min-p beside."""
    from pagefleet.kernels import sampling_split

    V = 333
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, V, generator=g) * 0.4
    top_p = [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95] * 2
    top_k = [0] * 8 + [200, 0, 150, 0, 300, 0, 100, 0]
    min_p = [0.0] * 12 + [0.0, 0.6, 0.0, 0.5]
    rec = records(1.0, top_k, top_p, min_p, seed=np.arange(16) * 13 + rounds, position=np.arange(16))
    out = torch.full((16,), -5, dtype=torch.int64)
    got = sampling_split.sample_split(x, rec, out.clone(), chunk=64, rounds=rounds)
    want = ref.sample(x, rec, out.clone())
    assert torch.equal(got, want), (got, want)
    unfiltered = ref.sample(x, records(1.0, seed=np.arange(16) * 13 + rounds, position=np.arange(16)))
    assert int((unfiltered != want).sum()) >= 6  # the first candidate was rejected in these rows


def test_triton_split_filter_classes_leave_out_launches_and_draw_the_same():
    """The split path told which filters no row uses (the sampler's three classes) draws what the full path
    draws on rows that use only the filters left in; temperature alone needs neither the max nor the rounds."""
    from pagefleet.kernels import sampling_split

    V = 200
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, V, generator=g) * 2.0
    plain = records([1.0, 0.7, 0.0, 1.3, 1.0, 2.0], seed=np.arange(6) + 1, position=2)
    narrowed = records([1.0, 0.7, 0.0, 1.3, 1.0, 2.0], 0, [0.9, 1.0, 0.5, 0.6, 0.95, 1.0],
                       [0.0, 0.1, 0.0, 0.0, 0.05, 0.2], seed=np.arange(6) + 1, position=2)
    out = torch.full((6,), -5, dtype=torch.int64)
    for rec, filters in ((plain, (False, False, False)), (narrowed, (False, True, True))):
        got = sampling_split.sample_split(x, rec, out.clone(), chunk=64, top_k=filters[0], top_p=filters[1],
                                          min_p=filters[2])
        full = sampling_split.sample_split(x, rec, out.clone(), chunk=64)
        assert torch.equal(got, full) and torch.equal(got, ref.sample(x, rec, out.clone())) and got[2] == -5


def test_triton_split_ties_and_the_automatic_switch():
    """Every tied token at a threshold is drawable through the split path (top-k 2 and top-p 0.3 over three tied
    at the top, one in each chunk of 16), as in the reference; split=None splits a batch of split_rows rows or
    fewer, True and False force either path."""
    n = 16  # P(one of three equally likely tokens never drawn) = 3 * (2 / 3)**16 = 0.005 (fixed seeds: no flake)
    x = torch.full((n, 40), -2.0)
    x[:, [3, 21, 39]] = 4.0
    for top_k, top_p in ((2, 1.0), (0, 0.3)):
        rec = records(1.0, top_k, top_p, seed=8, position=np.arange(n))
        got = sampling.sample(x, rec, split=True, chunk=16)
        assert torch.equal(got, ref.sample(x, rec)) and set(got.tolist()) == {3, 21, 39}
    assert sampling.splits(1) and sampling.splits(16) and not sampling.splits(64)
    assert sampling.splits(4, split_rows=4) and not sampling.splits(5, split_rows=4)
    assert sampling.splits(256, split=True) and not sampling.splits(1, split=False)
