"""The state cache: every recurrent layer's conv and recurrent state per state slot, bound to the model, and each
step's slot copies, zeroes and snapshots (core/state_slots.py decides them).

Slots [0, num_slots) belong to running sequences, the ones after them to the prefix cache's snapshots. The
recurrent state is kept in the dtype bringup.ssm_state_dtype resolves (--mamba-ssm-cache-dtype); a slot is a few
KB on the tiny test models and ~150 MB at Qwen3.6-27B's shape in fp32 (48 DeltaNet layers of 48 x 128 x 128),
75 MB in bf16, which is why the slot count is sized against the memory budget and not only by max_num_seqs.
"""

from __future__ import annotations

import math

import torch

GiB = 1 << 30
STATE_SHARE = 0.5  # of the memory left after the weights, at most this share goes to state slots on a GPU
COPY_CHUNK_BYTES = 256 << 20  # a slot copy's gathered sources at most this big at once (_copy)


def is_stateful(model) -> bool:
    return hasattr(model, "state_shapes")


def slot_bytes(shapes: dict) -> int:
    """Bytes of one slot over every recurrent layer (conv state and recurrent state)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def slot_counts(runner, config, shapes: dict) -> tuple[int, int]:
    """(sequence slots, snapshot slots). One slot per sequence the scheduler may run (max_num_seqs) and, with
    prefix caching, a quarter as many snapshots; on a GPU both shrink to fit STATE_SHARE of what the weights
    leave of the card's fraction (the caller then lowers max_num_seqs to the slots there are)."""
    slots = config.max_num_seqs
    snapshots = max(1, slots // 4) if config.enable_prefix_caching else 0
    if runner.device.type == "cuda" and config.num_gpu_blocks_override is None:
        _, total = torch.cuda.mem_get_info(runner.device)
        left = total * config.gpu_memory_fraction - torch.cuda.memory_allocated(runner.device)
        fit = int(max(left, 0) * STATE_SHARE // slot_bytes(shapes))
        if slots + snapshots > fit:
            share = slots / (slots + snapshots)
            slots = max(1, int(fit * share))
            snapshots = max(fit - slots, 0) if config.enable_prefix_caching else 0
    if slots < 1:
        raise ValueError("no state slot fits in memory")
    return slots, snapshots


class StateCache:
    def __init__(self, shapes: dict, num_slots: int, num_snapshots: int, device: torch.device):
        """shapes: model.state_shapes(), {"conv": ((L, ...), dtype), "ssm": ((L, ...), dtype)} per slot."""
        (conv_shape, conv_dtype), (ssm_shape, ssm_dtype) = shapes["conv"], shapes["ssm"]
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        total = num_slots + num_snapshots
        # [layer, slot, ...]: one layer's slots are contiguous, each layer a view for the model
        self.conv = torch.zeros(conv_shape[0], total, *conv_shape[1:], dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(ssm_shape[0], total, *ssm_shape[1:], dtype=ssm_dtype, device=device)
        self.device = device

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def bind(self, model) -> None:
        model.bind_state_cache(self.conv, self.ssm)

    def before_forward(self, copies: list[tuple[int, int]], zeros: list[int]) -> None:
        """Copies first (forked samples from their parent, prefix hits from a snapshot), then zero the fresh
        slots. A copy's sources are gathered before any destination is written."""
        if copies:
            self._copy(copies)
        if zeros:
            z = torch.tensor(zeros, dtype=torch.long, device=self.device)
            self.conv[:, z] = 0
            self.ssm[:, z] = 0

    def after_forward(self, snapshots: list[tuple[int, int]]) -> None:
        """Sequences' states at a block boundary into their snapshot slots."""
        if snapshots:
            self._copy(snapshots)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Gathered COPY_CHUNK_BYTES of sources at a time: the GRPO fork of 64 prompts x n = 16 at Qwen3.6-27B's
        shape asked for one 23.2 GiB gather of ~160 slots and ran out of memory on the H200 (hybrid_bench run
        --grpo-prompts 64). Chunks read what the step before wrote, so a slot that is both read and written in
        one call (no caller does this) gets the single gather that reads every source first."""
        srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
        per = max(1, COPY_CHUNK_BYTES // max(self.ssm[:, 0].nbytes, self.conv[:, 0].nbytes, 1))
        if not set(srcs).isdisjoint(dsts):
            per = len(pairs)
        for i in range(0, len(pairs), per):
            src = torch.tensor(srcs[i:i + per], dtype=torch.long, device=self.device)
            dst = torch.tensor(dsts[i:i + per], dtype=torch.long, device=self.device)
            self.conv[:, dst] = self.conv[:, src]
            self.ssm[:, dst] = self.ssm[:, src]
