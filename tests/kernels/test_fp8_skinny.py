"""The weight-only FP8 GEMM (kernels/fp8_skinny.py): its plain-torch reference, and its interpreter tests
(test_fp8_skinny_triton.py) run from here in a child process, as test_kernels.py runs its own."""
from pathlib import Path

import pytest
import torch

from interpreter import run_under_interpreter
from pagefleet.kernels import reference as ref


def w8a16_reference(x, w8, scale, bias=None, gated=False):
    """x @ (w8 * scale)^T (+ bias) in fp32 over the dequantised weight (reference.fp8's semantics:
    W = w8.float() * scale), rounded to x's dtype once; gated: silu(gate) * up of the rounded halves."""
    y = x.float() @ (w8.float() * scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return ref.silu_and_mul(y.to(x.dtype)) if gated else y.to(x.dtype)


def test_reference_is_the_dequantised_product():
    """The reference against reference.skinny_matmul's weight_scale path and a dense matmul of the weight
    quantise_weight_fp8 came from (to e4m3's resolution)."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 64, generator=gen), torch.randn(32, 64, generator=gen)
    w8, scale = ref.quantize_weight_fp8(w)
    got = w8a16_reference(x, w8, scale)
    assert torch.allclose(got, ref.skinny_matmul(x, w8, weight_scale=scale), rtol=1e-5, atol=1e-5)
    dense = x @ w.t()
    assert ((got - dense).norm() / dense.norm()).item() < 0.05
    gated = w8a16_reference(x, w8, scale, gated=True)
    assert torch.allclose(gated, ref.silu_and_mul(got), rtol=1e-6, atol=1e-6)


def test_fp8_skinny_under_interpreter():
    """fp8_dot and its ops dispatch on tiny CPU shapes under the Triton interpreter, in a child process."""
    pytest.importorskip("triton")
    run_under_interpreter(Path(__file__).parent / "test_fp8_skinny_triton.py", timeout=120)
