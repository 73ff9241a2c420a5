"""pagefleet.kernels: Triton kernels for the hot path, each with a plain-torch reference.

The dispatching functions here pick the Triton kernel for CUDA tensors when Triton imports, and the
reference (reference.py) otherwise, so the engine can call them on any device. The Triton modules
(attention, prefill_attention, kv_cache, norm, rope, activation, greedy, fp8) are imported only on first CUDA use.
"""
import functools
import importlib

from . import reference
from .reference import rope_cos_sin_cache  # noqa: F401

__all__ = ["triton_available", "reference", "rope_cos_sin_cache", "write_kv_cache", "paged_decode_attention",
           "paged_prefill_attention", "rms_norm", "fused_add_rms_norm", "apply_rope", "rope_and_write_kv", "silu_and_mul",
           "argmax", "quantize_fp8_per_token", "fp8_linear", "fp8_gemm", "rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8"]


@functools.lru_cache(maxsize=None)
def triton_available():
    """True when Triton imports and a CUDA device is visible (the only place the Triton path runs)."""
    try:
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _dispatch(module, name):
    ref = getattr(reference, name)

    @functools.wraps(ref)
    def call(first, *args, **kwargs):
        if first.is_cuda and triton_available():
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)(first, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k in _REFERENCE_KWARGS}
        return ref(first, *args, **kwargs)

    return call


# Tuning knobs (block_n, num_splits, ...) only mean something to the Triton launchers.
_REFERENCE_KWARGS = {"scale", "max_seq_len", "out", "inplace", "eps", "bias", "out_dtype", "new_kv"}

write_kv_cache = _dispatch("kv_cache", "write_kv_cache")
paged_decode_attention = _dispatch("attention", "paged_decode_attention")
paged_prefill_attention = _dispatch("prefill_attention", "paged_prefill_attention")
rms_norm = _dispatch("norm", "rms_norm")
fused_add_rms_norm = _dispatch("norm", "fused_add_rms_norm")
apply_rope = _dispatch("rope", "apply_rope")
rope_and_write_kv = _dispatch("rope", "rope_and_write_kv")
silu_and_mul = _dispatch("activation", "silu_and_mul")
argmax = _dispatch("greedy", "argmax")
quantize_fp8_per_token = _dispatch("fp8", "quantize_fp8_per_token")
fp8_linear = _dispatch("fp8", "fp8_linear")
fp8_gemm = _dispatch("fp8", "fp8_gemm")
rms_norm_fp8 = _dispatch("norm", "rms_norm_fp8")
fused_add_rms_norm_fp8 = _dispatch("norm", "fused_add_rms_norm_fp8")
silu_and_mul_fp8 = _dispatch("activation", "silu_and_mul_fp8")
