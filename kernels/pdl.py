"""Programmatic dependent launch (PDL, Hopper and later) for the GEMV and the decode attention.

Launched with launch_pdl=True, a kernel is scheduled while the kernel ahead of it in the stream still
runs. Each of its programs calls gdc_wait() first, which returns once that kernel has exited and its
writes are visible, so results do not change: what overlaps is the launch itself. The wait must stay
ahead of every memory access, because the kernels share one buffer of arrival counters
(kernels/arrivals.py) that a launch may touch only once the launch before it has reset them.

H200, 8B shape, decode step at context 640, against graphs captured without it (benchmarks/decode_graphs_ab.py's
no_pdl arm, commit d38697d): bf16 at batch 1 / 8 / 16 4.057 / 4.331 / 4.531 -> 4.032 / 4.311 / 4.502 ms;
FP8 at 1 / 16 / 32 2.731 / 3.205 / 4.331 -> 2.708 / 3.185 / 4.316 ms. Only chains of our own kernels
gain: after a cuBLAS GEMM (bf16 from 17 rows) the attention is 0.4 % slower launched this way, so it is
launched so only when its caller says pdl_chain.

The release stays implicit, at exit. The layer-stack probe of commit 8a6b275 (benchmarks/pdl_probe.py
there) times the other places: releasing dependents at entry takes a layer from 118.7 to 155.4 us at
batch 1 (the early programs sit in gdc_wait on SM slots the kernel ahead still needs); after the main
loop (the code of commit f0ac536), from 118.7 to 121.7.
"""
import functools

import torch

# On: the gains above, with bit-identical results. A module constant, not an engine flag, so that a
# benchmark or a test can capture graphs without PDL to compare (tests/executor/test_engine_gpu.py does).
ENABLED = True


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def active(t: torch.Tensor) -> bool:
    return ENABLED and t.is_cuda and _hopper(
        t.device.index if t.device.index is not None else torch.cuda.current_device())
