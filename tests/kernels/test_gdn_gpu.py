"""Gated DeltaNet Triton kernels on CUDA at Qwen3.6-27B's DeltaNet shape against gdn_reference (fp32 and bf16).

The shape (transformers' qwen3_5 text config of the 27B checkpoint, ../shared/ANCHORS.md): 16 q/k heads and 48
value heads of dim 128, conv kernel 4, so 10240 conv channels. Varlen batches around the 64-token chunk, nonzero
initial states, padding rows (slot -1), and the decode kernels replayed from a CUDA graph. Skipped without CUDA.
"""
import os

import pytest
import torch

from pagefleet.kernels import gdn_reference as ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="needs CUDA (compiled Triton)")]
HK, HV, DK, DV, KW = 16, 48, 128, 128, 4
CONV = 2 * HK * DK + HV * DV
SLOTS = 80
# relative Frobenius error bounds: fp32 (ieee dots) and bf16 (outputs rounded to bf16; tf32 dots in the chunks)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}
STATE_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel_err(actual, expected):
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all()
    return ((a - e).norm() / e.norm().clamp(min=1e-12)).item()


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def layer_inputs(rows, dtype):
    """The in-projection's [qkv | z | b | a] row and views of it, the conv weight, A_log, dt_bias and nonzero
    slot states, as the layer hands them to ops."""
    proj = torch.randn(rows, CONV + HV * DV + 2 * HV, device="cuda").to(dtype)
    mixed, b, a = proj[:, :CONV], proj[:, CONV + HV * DV: CONV + HV * DV + HV], proj[:, CONV + HV * DV + HV:]
    w = (torch.randn(CONV, KW, device="cuda") * 0.5).to(dtype)
    A_log = torch.rand(HV, device="cuda").mul(16).add(1).log()  # the checkpoint's init: log U(1, 16)
    dt_bias = torch.randn(HV, device="cuda")
    conv_state = torch.randn(SLOTS, CONV, KW - 1, device="cuda").to(dtype)
    ssm_state = torch.randn(SLOTS, HV, DK, DV, device="cuda") * 0.05
    return mixed, a, b, w, A_log, dt_bias, conv_state, ssm_state


def split_qkv(qkv):
    n = qkv.shape[0]
    q, k, v = qkv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV)


def random_slots(n, pad_rows=()):
    slots = torch.randperm(SLOTS, device="cuda")[:n].int()
    slots[list(pad_rows)] = -1
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_at_27b_shape(dtype):
    """Batch 64 decode: the conv update then the recurrent step, three steps in a row, two padding rows."""
    from pagefleet.kernels import causal_conv1d, gdn_recurrent

    _, _, _, w, A_log, dt_bias, conv_state, ssm_state = layer_inputs(1, dtype)
    conv_ref, ssm_ref = conv_state.clone(), ssm_state.clone()
    slots = random_slots(64, pad_rows=(5, 63))
    for _ in range(3):
        mixed, a, b, *_ = layer_inputs(64, dtype)
        y = causal_conv1d.causal_conv1d(mixed, w, conv_state, slots)
        y_ref = ref.causal_conv1d(mixed, w, conv_ref, slots)
        assert rel_err(y, y_ref) < TOL[dtype]
        assert torch.equal(conv_state, conv_ref)
        o = gdn_recurrent.recurrent_gated_delta_rule(*split_qkv(y_ref), a, b, A_log, dt_bias, ssm_state, slots)
        g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
        o_ref = ref.recurrent_gated_delta_rule(*split_qkv(y_ref), g, beta, ssm_ref, slots)
        assert rel_err(o, o_ref) < TOL[dtype]
        assert rel_err(ssm_state, ssm_ref) < STATE_TOL[dtype]
        assert not o[[5, 63]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 300, 2, 1000], [4096]])
def test_prefill_at_27b_shape(dtype, lens):
    """Varlen prefill from nonzero states: the conv, then the chunked rule; one padding sequence of 7 tokens."""
    from pagefleet.kernels import causal_conv1d, gdn_chunk

    lens = [*lens, 7]
    mixed, a, b, w, A_log, dt_bias, conv_state, ssm_state = layer_inputs(sum(lens), dtype)
    conv_ref, ssm_ref = conv_state.clone(), ssm_state.clone()
    slots = random_slots(len(lens), pad_rows=(len(lens) - 1,))
    y = causal_conv1d.causal_conv1d(mixed, w, conv_state, slots, cu(lens))
    y_ref = ref.causal_conv1d(mixed, w, conv_ref, slots, cu(lens))
    assert rel_err(y, y_ref) < TOL[dtype]
    assert torch.equal(conv_state, conv_ref)
    o = gdn_chunk.chunk_gated_delta_rule(*split_qkv(y_ref), a, b, A_log, dt_bias, ssm_state, slots, cu(lens))
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    o_ref = ref.chunk_gated_delta_rule(*split_qkv(y_ref), g, beta, ssm_ref, slots, cu(lens))
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(ssm_state, ssm_ref) < STATE_TOL[dtype]
    assert not o[-7:].any()


def test_bf16_state_storage_at_27b_shape():
    """--mamba-ssm-cache-dtype bfloat16 (auto on a bf16 checkpoint without mamba_ssm_dtype): a 300-token chunk,
    then three decode steps, over a bf16 state against the reference over the same storage."""
    from pagefleet.kernels import gdn_chunk, gdn_recurrent

    dtype = torch.bfloat16
    mixed, a, b, _, A_log, dt_bias, _, ssm_state = layer_inputs(300, dtype)
    ssm_state = ssm_state.to(dtype)
    ssm_ref = ssm_state.clone()
    slots = random_slots(4, pad_rows=(3,))
    lens = [100, 150, 40, 10]
    o = gdn_chunk.chunk_gated_delta_rule(*split_qkv(mixed), a, b, A_log, dt_bias, ssm_state, slots, cu(lens))
    g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
    o_ref = ref.chunk_gated_delta_rule(*split_qkv(mixed), g, beta, ssm_ref, slots, cu(lens))
    assert rel_err(o, o_ref) < TOL[dtype]
    for _ in range(3):
        mixed, a, b, *_ = layer_inputs(4, dtype)
        o = gdn_recurrent.recurrent_gated_delta_rule(*split_qkv(mixed), a, b, A_log, dt_bias, ssm_state, slots)
        g, beta = ref.gdn_gating(A_log, a, dt_bias, b)
        o_ref = ref.recurrent_gated_delta_rule(*split_qkv(mixed), g, beta, ssm_ref, slots)
        assert rel_err(o, o_ref) < TOL[dtype]
    assert ssm_state.dtype == dtype and rel_err(ssm_state, ssm_ref) < STATE_TOL[dtype]


def test_decode_kernels_replay_from_a_graph():
    """Captured once, replayed over new inputs and slot orders: the same outputs and states as eager launches."""
    from pagefleet.kernels import causal_conv1d, gdn_recurrent

    dtype = torch.bfloat16
    mixed, a, b, w, A_log, dt_bias, conv_state, ssm_state = layer_inputs(32, dtype)
    slots = random_slots(32, pad_rows=(31,))

    def step():
        qkv = causal_conv1d.causal_conv1d(mixed, w, conv_state, slots)
        return gdn_recurrent.recurrent_gated_delta_rule(*split_qkv(qkv), a, b, A_log, dt_bias, ssm_state, slots)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        new = layer_inputs(32, dtype)
        mixed.copy_(new[0]), a.copy_(new[1]), b.copy_(new[2])
        slots.copy_(random_slots(32, pad_rows=(0, 31)))
        conv_eager, ssm_eager = conv_state.clone(), ssm_state.clone()
        qkv = causal_conv1d.causal_conv1d(mixed, w, conv_eager, slots)
        expected = gdn_recurrent.recurrent_gated_delta_rule(*split_qkv(qkv), a, b, A_log, dt_bias, ssm_eager, slots)
        graph.replay()
        assert torch.equal(out, expected)
        assert torch.equal(conv_state, conv_eager) and torch.equal(ssm_state, ssm_eager)


def test_prefill_kernels_replay_from_a_graph():
    """A prompt step's conv and chunked rule captured at 512 tokens and 4 sequences, replayed over other length
    splits (padding sequences as the prompt graphs stage them: no tokens, slot -1): as eager launches."""
    from pagefleet.kernels import causal_conv1d, gdn_chunk

    dtype = torch.bfloat16
    mixed, a, b, w, A_log, dt_bias, conv_state, ssm_state = layer_inputs(512, dtype)
    cu_dev = cu([100, 200, 150, 62])
    slots = random_slots(4)

    def step(conv, ssm):
        qkv = causal_conv1d.causal_conv1d(mixed, w, conv, slots, cu_dev)
        return gdn_chunk.chunk_gated_delta_rule(*split_qkv(qkv), a, b, A_log, dt_bias, ssm, slots, cu_dev)

    step(conv_state.clone(), ssm_state.clone())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(conv_state, ssm_state)
    for lens, pads in (([300, 1, 65, 146], ()), ([64, 448], (2, 3)), ([7, 500], (3,))):
        lens = [*lens, 0, 0][:4] if len(lens) < 4 else lens
        cu_dev.copy_(cu(lens))
        slots.copy_(random_slots(4, pad_rows=pads))
        conv_eager, ssm_eager = conv_state.clone(), ssm_state.clone()
        expected = step(conv_eager, ssm_eager)
        graph.replay()
        assert torch.equal(out, expected)
        assert torch.equal(conv_state, conv_eager) and torch.equal(ssm_state, ssm_eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_at_27b_shape(dtype):
    """The output norm over a 4k-token prefill's rows, z a strided view of the in-projection."""
    from pagefleet.kernels import gdn_norm

    x = torch.randn(4096, HV, DV, device="cuda").to(dtype)
    z = torch.randn(4096, CONV + HV * DV, device="cuda").to(dtype)[:, CONV:].view(4096, HV, DV)
    w = (torch.randn(DV, device="cuda") * 0.3 + 1).to(dtype)
    assert rel_err(gdn_norm.gated_rms_norm(x, z, w), ref.gated_rms_norm(x, z, w)) < TOL[dtype]
