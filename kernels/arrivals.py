"""Arrival counters for kernels whose last program to finish a piece of work merges the others' partials.

Decode attention (split keys), the skinny GEMV (split K) and greedy argmax (row chunks) each end with
`if atomic_add(counter, 1) == parts - 1: merge`, and the merging program sets its counter back to 0. So
the counters are zeroed once, at allocation, and stay zero between launches. One buffer serves every
kernel on a device: the engine launches them one after another on one stream, and each starts at
offset 0 only after the previous launch has finished and left all its counters at 0.
"""
import torch

SIZE = 1 << 16  # counters: 2,048 sequences of 32 KV heads, or a GEMV's N / 16 tiles for N up to 10**6
_by_device: dict = {}
_retired: list = []  # outgrown buffers: CUDA graphs captured with them still point at them


def counters(device, n):
    """The device's zeroed int32 counters, at least n of them; None only while a CUDA graph is being
    captured and there are none yet, or too few (the capture would record their zeroing into the graph:
    call reserve() before capturing). Outside a capture a buffer too small is replaced by a larger one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must find the same buffer
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _by_device.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and (buf is None or buf.numel() < n):
        if buf is not None:
            _retired.append(buf)
        buf = _by_device[device] = torch.zeros(max(SIZE, n), dtype=torch.int32, device=device)
    return buf if buf is not None and n <= buf.numel() else None


def reserve(device):
    """Allocate the device's counters now (before a CUDA graph capture that launches merging kernels)."""
    counters(device, 0)
