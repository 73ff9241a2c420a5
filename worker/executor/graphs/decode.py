"""Decode steps as CUDA graphs: one graph per captured batch size over static input buffers.

A pure decode step of n sequences is padded to the next captured size: its inputs are copied into the
static buffers (padding rows write to slot -1, i.e. nowhere, and see one key), then the graph replays the
whole model forward and the lm_head in one launch.

Every graph writes its logits into one static buffer [max batch, vocab] (a buffer per graph would cost
2 GB at 512 sequences).
"""

from __future__ import annotations

import numpy as np
import torch

from pagefleet.worker.executor.graphs.base import StepGraphs
from pagefleet.worker.executor.state_cache import is_stateful
from pagefleet.worker.executor.step_inputs import StepInputs, feed_device_tokens, sampled_rows
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (at most 512), and max_num_seqs itself."""
    top = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs(StepGraphs):
    def __init__(self, model, device: torch.device, sizes: list[int], max_model_len: int, max_blocks_per_seq: int):
        super().__init__(model, sizes)
        self.sizes = sizes
        self.max_batch = sizes[-1]
        self.max_model_len = max_model_len
        m = self.max_batch
        tokens = torch.zeros(3, m, dtype=torch.long, device=device)  # input ids, positions, slots: one copy per step
        tokens[2].fill_(-1)
        self.tokens = tokens
        self.seq_lens = torch.ones(m, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(m, -(-max_blocks_per_seq // 4) * 4, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.logits = torch.empty(m, model.lm_head.weight.shape[0], dtype=model.lm_head.weight.dtype, device=device)
        # a model with recurrent state: each row's state slot, -1 (read and written by nobody) on padding rows
        self.state_slots = torch.full((m,), -1, dtype=torch.int32, device=device) if is_stateful(model) else None

    @classmethod
    def for_config(cls, model, device, config, max_model_len: int, max_blocks_per_seq: int) -> DecodeGraphs:
        return cls(model, device, batch_sizes(config.max_num_seqs), max_model_len, max_blocks_per_seq)

    @staticmethod
    def reserve_bytes(config, vocab_size: int, dtype: torch.dtype, activation_peak: int) -> int:
        """The shared logits buffer; the activations fit in the pool the profiled step leaves."""
        return batch_sizes(config.max_num_seqs)[-1] * vocab_size * dtype.itemsize

    def _captured(self) -> str:
        return f"{len(self.sizes)} decode CUDA graphs (batch 1..{self.max_batch})"

    def _forward(self, bs: int, graphed: bool) -> None:
        ids, positions, slots = self.tokens
        meta = AttentionMetadata(slots[:bs], self.block_tables[:bs], self.seq_lens[:bs], self.cu_seqlens_q[: bs + 1],
                                 self.max_model_len, True,
                                 state_slots=None if self.state_slots is None else self.state_slots[:bs])
        with forward_context(meta, graphed=graphed):
            self.model.compute_logits(self.model(ids[:bs], positions[:bs]), out=self.logits[:bs])

    def fits(self, step: StepInputs) -> bool:
        return step.is_decode and step.num_seqs <= self.max_batch

    def stage(self, step: StepInputs, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> int:
        """Copy one step's inputs into the static buffers, then the tokens still on the device (feed) into its
        input ids; -> the batch size to replay."""
        n = step.num_seqs
        bs = self._padded(n)
        self.tokens[:, :n].copy_(torch.from_numpy(step.tokens), non_blocking=True)
        self.tokens[2, n:bs].fill_(-1)  # padding rows write nowhere
        self.seq_lens[:n].copy_(torch.from_numpy(step.seq_lens), non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, : step.tables.shape[1]].copy_(torch.from_numpy(step.tables), non_blocking=True)
        if self.state_slots is not None:
            state_slots = np.full(bs, -1, dtype=np.int32)
            state_slots[:n] = step.state_slots
            self.state_slots[:bs].copy_(torch.from_numpy(state_slots), non_blocking=True)
        if feed is not None:
            feed_device_tokens(self.tokens[0, :n], feed)
        return bs

    def _sampled_logits(self, step: StepInputs) -> torch.Tensor:
        """The lm_head ran on every row: those that sample (a one-token chunk mid-prompt does not)."""
        logits = self.logits[: step.num_seqs]
        return sampled_rows(logits, step.logits_rows) if step.logits_rows else logits[:0]

    def _padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)
