"""Programmatic dependent launch (PDL) modes for a probe of why it made decode graphs slower (runs I, S).

MODE 0: off. 1: launched with the PDL attribute, no griddepcontrol in the kernel (the next kernel may
launch once this one has exited). 2: gdc_wait at entry. 3: gdc_wait and release at entry (run I).
4: gdc_wait at entry, release after the main loop (run S). 5: as 4, but before gdc_wait each program pulls
the first tiles it will read (weights; the attention's first keys and values) into L2. Hopper only.
"""
import torch
import triton
import triton.language as tl

MODE = 0


def mode(t: torch.Tensor) -> int:
    return MODE if MODE and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9 else 0


@triton.jit
def prefetch_l2(ptrs):
    """Start pulling the lines at ptrs into L2; nothing waits for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
