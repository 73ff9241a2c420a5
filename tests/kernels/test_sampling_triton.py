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
    from pagefleet.kernels import sampling


def both(x, rec, **blocks):
    out = torch.full((x.shape[0],), -5, dtype=torch.int64)
    got = sampling.sample(x, rec, out.clone(), **blocks)
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
    n = 300
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
    together = sampling.sample(x, rec, block=64, search_block=64)
    for i in range(6):
        assert sampling.sample(x[i:i + 1], rec[i:i + 1], block=64, search_block=64)[0] == together[i]
