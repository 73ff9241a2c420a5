"""kernels/fp8_skinny.py under the Triton interpreter (tiny shapes, fp32 / fp16), and ops' dispatch to it.

Runs only with TRITON_INTERPRET=1 set before Python starts: test_fp8_skinny.py launches it that way.
"""
import os

import pytest
import torch
from test_fp8_skinny import w8a16_reference
from test_kernels import DTYPES, close

from pagefleet.kernels import reference as ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests: run by test_fp8_skinny.py in a child process")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.importorskip("triton")
    from pagefleet.kernels import arrivals
    from pagefleet.kernels import fp8_skinny as FS

K = 112  # a multiple of 16, not of the 32-wide K tile: every split's last tile is masked or the last split is


def weights(n, gen, k=K):
    """e4m3 rows with per-row scales of very different sizes, as quantise_weight_fp8 makes them."""
    return ref.quantize_weight_fp8(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [5, 37, 100])  # padded to 16, 64 and 128 rows; none a multiple of 16
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_dot(dtype, M, split_k):
    """Plain with and without bias, gated (the up half with its own scales and bias), into a poisoned row
    view of a wider buffer; split K merged through counters that are back at 0 after each launch."""
    gen = torch.Generator().manual_seed(M + split_k)
    arrivals.reserve("cpu")
    x = torch.randn(M, K, generator=gen).to(dtype)
    w8, scale = weights(48, gen)
    bias = torch.randn(48, generator=gen).to(dtype)
    wide = torch.full((M, 64), float("nan"), dtype=dtype)
    FS.fp8_dot(x, w8, scale, bias, out=wide[:, :48], block_n=16, block_k=32, split_k=split_k)
    close(wide[:, :48], w8a16_reference(x.float(), w8, scale, bias.float()), dtype)
    assert torch.isnan(wide[:, 48:]).all()  # nothing written past N
    close(FS.fp8_dot(x, w8, scale, block_n=16, block_k=32, split_k=split_k),
          w8a16_reference(x.float(), w8, scale), dtype)
    assert not arrivals.counters("cpu", 0).any()

    g8, g_scale = weights(2 * 40, gen)  # 40 columns: the last 16-wide tile is part padding
    g_scale[40:] *= 3
    g_bias = torch.randn(80, generator=gen).to(dtype)
    got = FS.fp8_dot(x, g8, g_scale, g_bias, gated=True, block_n=16, block_k=32, split_k=split_k)
    assert got.shape == (M, 40)
    close(got, w8a16_reference(x.float(), g8, g_scale, g_bias.float(), gated=True), dtype)
    assert not arrivals.counters("cpu", 0).any()


def test_fp8_dot_defaults_and_checks():
    """The default config (split from the shape) on a longer K; the scale applies (doubled scales, twice
    the product); fp32 scales and M <= 128 only."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 2048, generator=gen)
    w8, scale = weights(32, gen, 2048)
    assert FS.default_config(64, 32, 2048, num_sms=132)[-1] > 1  # the default splits this K
    expected = w8a16_reference(x, w8, scale)
    close(FS.fp8_dot(x, w8, scale), expected, torch.float32)
    close(FS.fp8_dot(x, w8, 2 * scale, block_n=16, block_k=64), 2 * expected, torch.float32)
    with pytest.raises(AssertionError):
        FS.fp8_dot(x, w8, scale.half())
    with pytest.raises(AssertionError):
        FS.fp8_dot(torch.randn(129, 2048), w8, scale)
    with pytest.raises(ValueError):
        FS.fp8_dot(x, w8, scale, block_n=8)


def test_ops_dispatch_to_fp8_dot(monkeypatch):
    """Inside a graph capture's forward context, e4m3 linears of 33..FP8_DOT_MAX_ROWS half-precision rows go to
    fp8_dot (results equal to a direct call), and the norms and the activation hand those rows over in
    bf16 / fp16, not as Fp8Rows; at 32 rows, outside a capture, or with the constant at 0 (as committed),
    nothing changes."""
    from pagefleet.worker.models.layers import ops
    from pagefleet.worker.models.layers.context import forward_context

    gen = torch.Generator().manual_seed(9)
    dt = torch.float16
    x = torch.randn(40, K, generator=gen).to(dt)
    w8, scale = weights(48, gen)
    g8, g_scale = weights(64, gen)
    bias = torch.randn(48, generator=gen).to(dt)
    norm_w = torch.rand(K, generator=gen).to(dt) + 0.5
    assert ops.FP8_DOT_MAX_ROWS == 0  # off until timed on the H200
    ops.use_triton(True)
    try:
        with forward_context(None, graphed=True):
            assert not ops.fp8_dot_rows(x)
            assert isinstance(ops.rms_norm_fp8(x, norm_w, 1e-5), ops.Fp8Rows)
            monkeypatch.setattr(ops, "FP8_DOT_MAX_ROWS", 128)
            assert ops.fp8_dot_rows(x) and not ops.fp8_dot_rows(x[:32]) and not ops.fp8_dot_rows(x.float())
            assert torch.equal(ops.linear(x, w8, bias, weight_scale=scale), FS.fp8_dot(x, w8, scale, bias))
            out = torch.full((40, 48), float("nan"), dtype=dt)
            assert ops.linear(x, w8, weight_scale=scale, out=out) is out
            assert torch.equal(out, FS.fp8_dot(x, w8, scale))
            assert torch.equal(ops.linear_silu_and_mul(x, g8, weight_scale=g_scale),
                               FS.fp8_dot(x, g8, g_scale, gated=True))
            normed = ops.rms_norm_fp8(x, norm_w, 1e-5)
            assert not isinstance(normed, ops.Fp8Rows) and torch.equal(normed, ops.rms_norm(x, norm_w, 1e-5))
            normed, res = ops.fused_add_rms_norm_fp8(x, x.clone(), norm_w, 1e-5)
            assert not isinstance(normed, ops.Fp8Rows) and normed.dtype == dt
            assert torch.equal(ops.silu_and_mul_fp8(x[:, :64]), ops.silu_and_mul(x[:, :64]))
            assert isinstance(ops.silu_and_mul_fp8(x[:32, :64]), ops.Fp8Rows)  # 32 rows: the GEMV's, as before
        assert not ops.fp8_dot_rows(x)  # eager: Triton launches cost the host more than cuBLAS's
    finally:
        ops.use_triton(False)
