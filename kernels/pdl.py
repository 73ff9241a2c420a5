"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels a decode graph chains.

Off unless ENABLED is set (benchmarks/decode_graphs_ab.py measures it). When on, a launch captured into
a CUDA graph carries launch_pdl=True: the GPU may start the kernel's programs as soon as every program of
the kernel before it has called gdc_launch_dependents, which ours do once their main loop is done (not at
entry: run I released them there, and the early programs, parked in gdc_wait, held SM slots the previous
kernel still needed). Every program calls gdc_wait before it touches memory, and that waits for the
previous kernel to finish and its writes to be visible, so results do not change. What can overlap is
one kernel's launch and start-up with the end of the one before.
"""
import torch

ENABLED = False


def active(t: torch.Tensor) -> bool:
    """Launch with PDL: switched on, on a Hopper-class GPU, inside a CUDA graph capture."""
    return (ENABLED and t.is_cuda and torch.cuda.is_current_stream_capturing()
            and torch.cuda.get_device_capability(t.device)[0] >= 9)
