"""pagefleet.kernels: Triton kernels for the hot path, each with its plain-torch reference (reference.py).

attention (paged decode), prefill_attention, kv_cache, rope, norm, activation, gemv (tiles in gemv_tiles),
fp8 and greedy hold the kernels; arrivals the counters their split launches merge by; pdl the programmatic
dependent launch. The Triton modules import triton, so nothing imports them here: the models choose them
or the references through one switch, pagefleet.worker.models.layers.ops. Nothing in this package imports
the rest of pagefleet: a kernel knows tensors, not sequences.
"""

from . import reference

__all__ = ["reference"]
