"""Gated DeltaNet Triton kernels against gdn_reference under the Triton interpreter (tiny shapes, fp32 / fp16).

Runs only with TRITON_INTERPRET=1 set before Python starts: test_kernels.py launches it that way in a child
process. Directly: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gdn_triton.py
"""
import importlib
import os

import pytest
import torch
from test_kernels import DTYPES, close

from pagefleet.kernels import gdn_reference as ref

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests: run by test_kernels.py in a child process")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.importorskip("triton")
    TK = {name: importlib.import_module(f"pagefleet.kernels.{name}")
          for name in ("causal_conv1d", "gdn_chunk", "gdn_norm", "gdn_recurrent")}

HK, HV, DK, DV, KW = 2, 4, 16, 32, 4  # two value heads per q/k head, as Qwen3.6-27B has three
CONV = 2 * HK * DK + HV * DV
SLOTS = 6


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def conv_inputs(rows, dtype, gen):
    """x as a strided view (the in-projection's first columns), a random weight, random slot states."""
    x = torch.randn(rows, CONV + 24, generator=gen).to(dtype)[:, :CONV]
    return x, torch.randn(CONV, KW, generator=gen).to(dtype), torch.randn(SLOTS, CONV, KW - 1, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_decode(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, state = conv_inputs(5, dtype, gen)
    slots = torch.tensor([1, -1, 4, 0, 2], dtype=torch.int32)  # row 1 pads: zero output, no state touched
    expected_state = state.clone()
    y = TK["causal_conv1d"].causal_conv1d(x, w, state, slots)
    expected = ref.causal_conv1d(x, w, expected_state, slots)
    close(y, expected, dtype)
    assert not y[1].any()
    assert torch.equal(state, expected_state)  # the window slides by copies: exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_varlen(dtype):
    """Lengths below, at and past K - 1 (a 1- and 2-token sequence shift inside the old state), an empty
    sequence, a padding sequence and rows past the last sequence (zero output)."""
    gen = torch.Generator().manual_seed(1)
    lens = [5, 1, 40, 0, 2, 3]
    x, w, state = conv_inputs(sum(lens) + 3, dtype, gen)
    slots = torch.tensor([3, 0, 5, 2, 1, -1], dtype=torch.int32)
    expected_state = state.clone()
    y = TK["causal_conv1d"].causal_conv1d(x, w, state, slots, cu(lens))
    expected = ref.causal_conv1d(x, w, expected_state, slots, cu(lens))
    close(y, expected, dtype)
    assert not y[sum(lens) - 3:].any()
    assert torch.equal(state, expected_state)


def test_conv_prefill_in_pieces_equals_whole():
    """A prompt in two calls (chunked prefill) gives the rows and the state of one call."""
    gen = torch.Generator().manual_seed(2)
    x, w, state = conv_inputs(23, torch.float32, gen)
    slots = torch.tensor([4], dtype=torch.int32)
    whole_state = state.clone()
    whole = TK["causal_conv1d"].causal_conv1d(x, w, whole_state, slots, cu([23]))
    first = TK["causal_conv1d"].causal_conv1d(x[:2], w, state, slots, cu([2]))
    second = TK["causal_conv1d"].causal_conv1d(x[2:], w, state, slots, cu([21]))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, whole_state)


def rule_inputs(rows, dtype, gen):
    """q, k, v as views of one conv output row, a, b as views of the in-projection, the layer's A_log and dt_bias,
    and nonzero fp32 slot states."""
    qkv = torch.randn(rows, CONV, generator=gen).to(dtype)
    q = qkv[:, : HK * DK].view(rows, HK, DK)
    k = qkv[:, HK * DK: 2 * HK * DK].view(rows, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(rows, HV, DV)
    ab = torch.randn(rows, 2 * HV + 3, generator=gen).to(dtype)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen)
    state = torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.3
    return q, k, v, ab[:, :HV], ab[:, HV: 2 * HV], A_log, dt_bias, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_step(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(5, dtype, gen)
    slots = torch.tensor([1, -1, 4, 0, 2], dtype=torch.int32)
    expected_state = state.clone()
    for _ in range(2):  # the second step reads what the first wrote
        o = TK["gdn_recurrent"].recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots)
        g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
        expected = ref.recurrent_gated_delta_rule(q, k, v, g, beta, expected_state, slots)
        close(o, expected, dtype)
        close(state, expected_state, torch.float32)
    assert not o[1].any()
    assert torch.equal(state[[3, 5]], expected_state[[3, 5]])  # slots nobody holds are untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_rule_varlen(dtype):
    """Sequences shorter than a chunk, of one token, past one chunk (70 = 64 + 6), empty, and a padding one,
    each from its own nonzero state."""
    gen = torch.Generator().manual_seed(4)
    lens = [5, 1, 70, 0, 3]
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(sum(lens), dtype, gen)
    slots = torch.tensor([3, 0, 5, 2, -1], dtype=torch.int32)
    expected_state = state.clone()
    o = TK["gdn_chunk"].chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu(lens))
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    expected = ref.chunk_gated_delta_rule(q, k, v, g, beta, expected_state, slots, cu(lens))
    close(o, expected, dtype)
    close(state, expected_state, dtype)  # a half model's products take half-precision operands
    assert not o[-3:].any()
    assert torch.equal(state[[1, 2, 4]], expected_state[[1, 2, 4]])  # padding, empty and free slots untouched


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_state_storage(state_dtype):
    """--mamba-ssm-cache-dtype bfloat16 / float16: both kernels read the stored state up to fp32, run the rule in
    fp32 and round the new state once on the way back, as the reference does with the same storage. Three steps
    (a 70-token chunk, then two decodes) so a rounding bug compounds."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(72, torch.float32, gen)
    state = state.to(state_dtype)
    slots = torch.tensor([4], dtype=torch.int32)
    expected_state = state.clone()
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    o = TK["gdn_chunk"].chunk_gated_delta_rule(q[:70], k[:70], v[:70], a[:70], b[:70], A_log, dt_bias, state,
                                               slots, cu([70]))
    expected = ref.chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], expected_state, slots, cu([70]))
    close(o, expected, torch.float16)
    for i in (70, 71):
        o = TK["gdn_recurrent"].recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1],
                                                           b[i:i + 1], A_log, dt_bias, state, slots)
        expected = ref.recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                                  expected_state, slots)
        close(o, expected, state_dtype)
    assert state.dtype == state_dtype
    close(state.float(), expected_state.float(), state_dtype)
    assert torch.equal(state[[0, 1, 2, 3, 5]], expected_state[[0, 1, 2, 3, 5]])  # other slots untouched


def test_state_dtype_is_checked():
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(2, torch.float32, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        TK["gdn_recurrent"].recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state.double(),
                                                       torch.tensor([0, 1], dtype=torch.int32))


def test_launch_settings_do_not_change_the_rule():
    """The tile sweep's overrides (benchmarks/gdn_tile_bench.py) give the default launch's outputs and states."""
    gen = torch.Generator().manual_seed(8)
    lens = [5, 70, 3]
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(sum(lens), torch.float32, gen)
    slots = torch.tensor([3, 0, 5], dtype=torch.int32)
    base_state = state.clone()
    base = TK["gdn_chunk"].chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, base_state, slots, cu(lens))
    swept = TK["gdn_chunk"].chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, cu(lens),
                                                   launch={"state_bv": 16, "state_warps": 4, "prepare_warps": 4})
    close(swept, base, torch.float32)
    close(state, base_state, torch.float32)
    rows = slice(0, 3)
    one = state.clone()
    o1 = TK["gdn_recurrent"].recurrent_gated_delta_rule(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias,
                                                        one, slots)
    o2 = TK["gdn_recurrent"].recurrent_gated_delta_rule(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias,
                                                        state, slots, block_v=16, num_warps=2)
    close(o2, o1, torch.float32)
    close(state, one, torch.float32)


def test_chunk_then_recurrent_equals_recurrent_only():
    """The chunked form and the recurrent step are one rule: a 9-token prompt through the chunk kernel, then a
    decode, leaves the state and output of ten recurrent steps."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, a, b, A_log, dt_bias, state = rule_inputs(10, torch.float32, gen)
    slots = torch.tensor([2], dtype=torch.int32)
    stepped = state.clone()
    outs = [TK["gdn_recurrent"].recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], a[i:i + 1],
                                                           b[i:i + 1], A_log, dt_bias, stepped, slots)
            for i in range(10)]
    o = TK["gdn_chunk"].chunk_gated_delta_rule(q[:9], k[:9], v[:9], a[:9], b[:9], A_log, dt_bias, state, slots,
                                               cu([9]))
    last = TK["gdn_recurrent"].recurrent_gated_delta_rule(q[9:], k[9:], v[9:], a[9:], b[9:], A_log, dt_bias,
                                                          state, slots)
    close(torch.cat([o, last]), torch.cat(outs), torch.float32)
    close(state, stepped, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["model", torch.float32])  # rounded after the weight, or not
def test_gated_rms_norm(dtype, weight_dtype):
    """Rows of 5 tokens x 4 heads, z a strided view of a wider projection: as the reference, rounding included."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, HV, DV, generator=gen).to(dtype)
    z = torch.randn(5, HV * DV + 8, generator=gen).to(dtype)[:, 8:].view(5, HV, DV)
    w = (torch.randn(DV, generator=gen) * 0.3 + 1).to(dtype if weight_dtype == "model" else weight_dtype)
    out = TK["gdn_norm"].gated_rms_norm(x, z, w, 1e-6)
    expected = ref.gated_rms_norm(x, z, w, 1e-6)
    assert out.dtype == expected.dtype == dtype
    close(out, expected, dtype)
