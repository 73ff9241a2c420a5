"""The kernel switch: every operation the models call, as a Triton kernel on CUDA or its torch reference.

One switch, chosen once per process: `use_triton(True/False)`; the model runner sets it from the device.
Models and layers reach pagefleet.kernels only through here. Every call is on the hot path of an eager
step: the switch is one module global (`_triton`), read per call.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagefleet.kernels import gdn_reference as gdn_ref
from pagefleet.kernels import reference as ref
from pagefleet.worker.models.layers.context import is_graphed

_triton = None  # the kernels modules when Triton is in use, else None


def use_triton(enabled: bool) -> None:
    global _triton
    if not enabled:
        _triton = None
        return
    # imported here, not at the top: the Triton modules import triton, which CPU-only processes skip
    names = ("activation", "arrivals", "attention", "cascade", "causal_conv1d", "fp8", "fp8_skinny", "gdn_chunk",
             "gdn_norm", "gdn_recurrent", "gemv", "greedy", "kv_cache", "norm", "prefill_attention", "rope")
    _triton = {name: importlib.import_module(f"pagefleet.kernels.{name}") for name in names}


# Load-time work, not launches: the same torch code on every device, run once per model load.
rope_cos_sin_cache = ref.rope_cos_sin_cache
quantize_weight_fp8 = ref.quantize_weight_fp8

# Up to this many token rows a bf16 linear is a weight read, and our GEMV beats cuBLAS at every decoder
# shape (8B, M = 16: qkv 15.4 against 16.1 us, down 31.2 against 32.5; H200, benchmarks/gemv_bench.py).
# From 17 to 32 rows it made decode steps about 1 % slower (5.199 against 5.139 ms at batch 17, H200,
# benchmarks/decode_graphs_ab.py in commit f0ac536). A constant, not a flag; tests may patch it.
SKINNY_MAX_ROWS = 16
# e4m3 weights: at 32 rows the GEMV still beats quantise + _scaled_mm on every decoder shape (down 27.9 us
# against 42.0; batch-32 decode step 5.60 -> 4.77 ms), at 64 it loses on three of four (H200,
# benchmarks/gemv_bench.py; docs/benchmarks-kernels.md)
SKINNY_MAX_ROWS_FP8 = 32
# From there to this many rows an e4m3 linear inside a graph is our fp8 tensor-core GEMM (kernels/fp8_skinny.py)
# instead of torch._scaled_mm: the 8B shape's 32 layers of linears take 3,280 against 3,759 us at 64 rows and
# 3,234 against 3,626 at 48; at 80 rows gate_up is slower than _scaled_mm (H100, benchmarks/fp8_skinny_bench.py).
FP8_SKINNY_MAX_ROWS = 64


def skinny_rows(x, fp8: bool = False) -> bool:
    """True where linears of x's rows (or of the tokens x holds) go to our GEMV: a graph capture of a few
    rows (fp8: of a model with e4m3 decoder weights). _skinny adds that the rows are half precision.

    Only inside a CUDA graph capture: a Triton launch costs the host far more than a cuBLAS call
    (--enforce-eager at batch 1 went from ~14 to ~49 ms a step), and a graph replays it for free."""
    max_rows = SKINNY_MAX_ROWS_FP8 if fp8 else SKINNY_MAX_ROWS
    return bool(_triton and x.shape[0] <= max_rows and is_graphed())


def _fp8_skinny(rows: int, weight) -> bool:
    """True where an e4m3 linear of `rows` token rows goes to kernels/fp8_skinny.py: past the GEMV's rows, up
    to FP8_SKINNY_MAX_ROWS, inside a graph capture (a Triton launch costs the host more than cuBLAS's), for a
    weight whose in-features are a multiple of 32 (the fp8 dot's K step; Fp8Linear asks only 16)."""
    return bool(_triton and SKINNY_MAX_ROWS_FP8 < rows <= FP8_SKINNY_MAX_ROWS and weight.shape[1] % 32 == 0
                and is_graphed())


def _fp8_gemm(q, scale, weight, weight_scale, bias, dtype):
    """Rows quantised per token @ e4m3 weight: our skinny GEMM where _fp8_skinny says, else _scaled_mm."""
    if _fp8_skinny(q.shape[0], weight):
        return _triton["fp8_skinny"].fp8_skinny_gemm(q, scale, weight, weight_scale, bias, out_dtype=dtype)
    return (_triton["fp8"] if _triton else ref).fp8_gemm(q, scale, weight, weight_scale, bias, out_dtype=dtype)


def reserve_arrivals(device) -> None:
    """Allocate the merging kernels' counters before a graph capture, which could not zero them."""
    if _triton:
        _triton["arrivals"].reserve(device)


def _skinny(x, weight, weight_scale=None) -> bool:
    return (skinny_rows(x, weight_scale is not None) and x.dtype in (torch.bfloat16, torch.float16)
            and (weight.dtype == x.dtype or weight_scale is not None))


class Fp8Rows(NamedTuple):
    """Token rows the kernel before an FP8 GEMM already quantised per token (e4m3 q [T, K], fp32 scale [T, 1]):
    what a norm or the activation hands the next e4m3 linear in place of bf16 rows. dtype: the rows' own
    dtype, which the GEMM writes."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def linear(x, weight, bias=None, out=None, weight_scale=None):
    """weight_scale [N] fp32: weight is e4m3 (layers/fp8.py). A decode graph's few rows then read it through our
    GEMV unquantised (weight-only FP8, half the bytes of bf16); other calls quantise x per token for
    torch._scaled_mm (kernels/fp8.py), unless x is Fp8Rows, quantised already."""
    if isinstance(x, Fp8Rows):
        y = _fp8_gemm(x.q, x.scale, weight, weight_scale, bias, x.dtype)
        return y if out is None else out.copy_(y)
    if _skinny(x, weight, weight_scale):
        return _triton["gemv"].skinny_matmul(x, weight, bias, out=out, weight_scale=weight_scale)
    if weight_scale is not None:
        rows = x.reshape(-1, x.shape[-1])
        if _fp8_skinny(rows.shape[0], weight):  # the attention's output before o_proj: quantised here
            y = _fp8_gemm(*_triton["fp8"].quantize_fp8_per_token(rows), weight, weight_scale, bias, x.dtype)
            y = y.reshape(*x.shape[:-1], weight.shape[0])
        else:
            y = (_triton["fp8"] if _triton else ref).fp8_linear(x, weight, weight_scale, bias)
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)


def linear_silu_and_mul(x, weight, bias=None, sumsq=None, eps=0.0, weight_scale=None):
    """The gated MLP's first half: silu_and_mul(linear(x, [gate; up])). In a decode graph one GEMV does
    both (the activation in its epilogue); elsewhere a GEMM, then the activation kernel.
    sumsq: x is a folded norm's input, as in linear_normed."""
    if sumsq is not None:
        return _gemv().skinny_matmul(x, weight, bias, gated=True, sumsq=sumsq, eps=eps,
                                     weight_scale=weight_scale)
    if _skinny(x, weight, weight_scale):
        return _triton["gemv"].skinny_matmul(x, weight, bias, gated=True, weight_scale=weight_scale)
    return silu_and_mul(linear(x, weight, bias, weight_scale=weight_scale))


# The folded-norm decode path (LlamaForCausalLM.forward_folded): our GEMV on CUDA, the references elsewhere.
def _gemv():
    return _triton["gemv"] if _triton else ref


def linear_normed(x, weight, bias, sumsq, eps, weight_scale=None):
    """linear(rms_norm(x)) where the norm's weight is folded into weight's columns and sumsq [n, M] holds
    partial sums of x's squared rows: the norm is a per-row scale of the product, not a launch."""
    return _gemv().skinny_matmul(x, weight, bias, sumsq=sumsq, eps=eps, weight_scale=weight_scale)


def linear_add(x, weight, bias, residual, weight_scale=None):
    """-> (residual + linear(x), partial sums of its squared rows [n, M]) for the linear_normed after it."""
    return _gemv().skinny_matmul(x, weight, bias, residual=residual, weight_scale=weight_scale)


def embed_rows(ids, table):
    """ids [M] -> (table[ids], their sums of squares [1, M] fp32): a folded decode step's embeddings and the
    sumsq its first GEMV reads (no GEMV wrote these rows)."""
    return (_triton["norm"] if _triton and ids.is_cuda else ref).embed_rows(ids, table)


def argmax(logits):
    """The first index of each row's maximum; on CUDA one launch spread over the GPU (torch's own takes
    36 us for one 128k-vocabulary row)."""
    return _triton["greedy"].argmax(logits) if _triton and logits.is_cuda else ref.argmax(logits)


def rms_norm(x, weight, eps):
    return _triton["norm"].rms_norm(x, weight, eps) if _triton else ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    impl = _triton["norm"] if _triton else ref
    return impl.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x):
    return _triton["activation"].silu_and_mul(x) if _triton else ref.silu_and_mul(x)


# The same three, quantised per token for the FP8 GEMM after them: one kernel instead of two, and no bf16
# round trip of the rows through memory.
def rms_norm_fp8(x, weight, eps) -> Fp8Rows:
    return Fp8Rows(*(_triton["norm"] if _triton else ref).rms_norm_fp8(x, weight, eps), x.dtype)


def fused_add_rms_norm_fp8(x, residual, weight, eps) -> tuple[Fp8Rows, torch.Tensor]:
    q, scale, new_residual = (_triton["norm"] if _triton else ref).fused_add_rms_norm_fp8(x, residual, weight, eps)
    return Fp8Rows(q, scale, x.dtype), new_residual


def silu_and_mul_fp8(x) -> Fp8Rows:
    return Fp8Rows(*(_triton["activation"] if _triton else ref).silu_and_mul_fp8(x), x.dtype)


def apply_rope(q, k, positions, cos_sin_cache):
    impl = _triton["rope"] if _triton else ref
    return impl.apply_rope(q, k, positions, cos_sin_cache)


def rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Rotate q and k and write k, v into the paged cache (one kernel on CUDA); -> rotated q."""
    impl = _triton["rope"] if _triton else ref
    return impl.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def decode_warmup_batches(max_num_seqs: int, num_kv_heads: int) -> list[int]:
    """One batch size for each decode-attention launch setting a step of up to max_num_seqs sequences can
    take (splits and key tile from decode_config, RoPE fused below ROPE_MAX_BATCH): what a warm-up runs so
    that no kernel variant compiles mid-run."""
    if not _triton:
        return []
    attention = _triton["attention"]
    first = {}
    for b in range(1, max_num_seqs + 1):
        first.setdefault((attention.decode_config(b, num_kv_heads), b < attention.ROPE_MAX_BATCH), b)
    return sorted(first.values())


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, out=None,
                           eager_step=False, new_kv=None, pdl_chain=False):
    """new_kv=(k, v, positions, cos_sin_cache, slot_mapping): q, k before RoPE; the same launch rotates them and
    writes k, v to the cache (one launch fewer a layer than rope_and_write_kv first).
    pdl_chain: q, k, v come straight from our GEMV, itself launched with programmatic dependent launch
    (kernels/pdl.py), so this launch may be too. After a cuBLAS GEMM or a norm it is slower launched so
    (5.249 against 5.228 ms a bf16 decode step at batch 32, H200, benchmarks/decode_graphs_ab.py in commit
    d38697d)."""
    if not _triton:
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                          max_seq_len=max_seq_len, out=out, new_kv=new_kv)
    # A pure decode step run eagerly (--enforce-eager) is bound by the host's launch rate, not the GPU:
    # splitting the keys would add a reduce launch and two allocations per layer for GPU time nobody
    # waits on (batch 1: 71 against 44 tok/s). Graph replays and mixed steps keep the split.
    splits = 1 if eager_step and not is_graphed() else None
    return _triton["attention"].paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, max_seq_len=max_seq_len, out=out,
        num_splits=splits, new_kv=new_kv, pdl_chain=pdl_chain,
    )


def cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, groups, prefix_lens):
    """Decode attention where groups of rows share their first blocks (kernels/cascade.py): q rotated, the step's
    keys in the cache already. The reference has no such split: it attends each row over its whole table."""
    if not _triton:
        return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                          max_seq_len=max_seq_len)
    return _triton["cascade"].cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, groups,
                                                       prefix_lens, scale=scale)


def cascade_samples(num_heads: int, num_kv_heads: int) -> int:
    """Rows one shared-prefix program serves (a longer run of rows sharing a prefix is cut into groups of this
    many); 0 without Triton, where decode attention has no cascade form."""
    return _triton["cascade"].samples_per_program(num_heads, num_kv_heads) if _triton else 0


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_seq_len,
                            out=None):
    impl = _triton["prefill_attention"] if _triton else ref
    return impl.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale, max_seq_len=max_seq_len, out=out
    )



# ---- Gated DeltaNet (layers/gated_deltanet.py): Triton kernels on CUDA (kernels/causal_conv1d.py, gdn_recurrent.py,
# gdn_chunk.py), the torch references (kernels/gdn_reference.py) elsewhere
def causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens=None):
    """Depthwise causal conv + SiLU over each sequence, continued from and updating its slot's conv state;
    cu_seqlens None: one token per sequence (decode)."""
    impl = _triton["causal_conv1d"] if _triton and x.is_cuda else gdn_ref
    return impl.causal_conv1d(x, weight, conv_state, state_slots, cu_seqlens)


def chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, cu_seqlens):
    """Prompt chunks: the gating (g, beta from a, b), then the chunked rule from each slot's state."""
    if _triton and v.is_cuda:
        return _triton["gdn_chunk"].chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots,
                                                           cu_seqlens)
    g, beta = gdn_ref.gdn_gating(A_log, a, dt_bias, b)
    return gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state, state_slots, cu_seqlens)


def recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots):
    """Decodes (row i is sequence i): the gating, then one recurrent step of each slot's state (one launch on
    CUDA, graph-capturable)."""
    if _triton and v.is_cuda:
        return _triton["gdn_recurrent"].recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state,
                                                                   state_slots)
    g, beta = gdn_ref.gdn_gating(A_log, a, dt_bias, b)
    return gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, state_slots)


def gated_rms_norm(x, z, weight, eps):
    return (_triton["gdn_norm"] if _triton and x.is_cuda else gdn_ref).gated_rms_norm(x, z, weight, eps)
