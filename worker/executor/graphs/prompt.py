"""Small prompt steps as CUDA graphs: one graph per token bucket over static input buffers.

A prompt step of a few hundred tokens launches about 400 kernels from Python. On the H200 its kernels
take 11.4 ms while the host takes 18-38 ms to launch them (docs/benchmarks.md, lone prompts): the time to first
token of a lone request is the host's. A graph replays those launches in one.

A prompt-only step (no decodes, no LoRA) of at most MAX_SEQS sequences and MAX_TOKENS tokens is padded to
the next bucket: padding tokens write their K/V nowhere (slot -1) and belong to no sequence, padding
sequences have no tokens, so the prefill kernel's spare tiles exit. The graph runs the model and the
lm_head on the rows that sample, into one static logits buffer, as the decode graphs do.
"""

from __future__ import annotations

import numpy as np
import torch

from pagefleet.worker.executor.graphs.base import StepGraphs
from pagefleet.worker.executor.state_cache import is_stateful
from pagefleet.worker.executor.step_inputs import StepInputs, feed_device_tokens
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata

MAX_SEQS = 4  # prompts per graphed step: a lone request, or a few arriving together
BUCKETS = (64, 128, 192, 256, 384, 512, 640, 768, 1024)  # tokens; the padding costs at most ~25 %


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    return [b for b in BUCKETS if b <= max_num_batched_tokens]


class PromptGraphs(StepGraphs):
    def __init__(self, model, device: torch.device, buckets: list[int], max_blocks_per_seq: int):
        super().__init__(model, buckets)
        self.buckets = buckets
        t, s = buckets[-1], MAX_SEQS
        self.tokens = torch.zeros(3, t, dtype=torch.long, device=device)  # input ids, positions, slots
        self.tokens[2].fill_(-1)
        self.chunks = chunks = ChunkInts(0, max_blocks_per_seq, device)
        self.seq_lens, self.cu_seqlens_q, self.block_tables = chunks.seq_lens, chunks.cu_seqlens_q, chunks.block_tables
        self.logits_rows = torch.zeros(s, dtype=torch.long, device=device)
        self.logits = torch.empty(s, model.lm_head.weight.shape[0], dtype=model.lm_head.weight.dtype, device=device)
        # a model with recurrent state: each prompt's state slot, -1 for the padding sequences
        self.state_slots = torch.full((s,), -1, dtype=torch.int32, device=device) if is_stateful(model) else None

    @classmethod
    def for_config(cls, model, device, config, max_model_len: int, max_blocks_per_seq: int) -> PromptGraphs | None:
        """None: the token budget is below the smallest bucket."""
        buckets = token_buckets(config.max_num_batched_tokens)
        return cls(model, device, buckets, max_blocks_per_seq) if buckets else None

    @staticmethod
    def reserve_bytes(config, vocab_size: int, dtype: torch.dtype, activation_peak: int) -> int:
        """Memory beyond the decode graphs' reserve: the largest bucket's share of the profiled step's
        activations, and the static logits."""
        buckets = token_buckets(config.max_num_batched_tokens)
        if not buckets:
            return 0
        return activation_peak * buckets[-1] // config.max_num_batched_tokens + MAX_SEQS * vocab_size * dtype.itemsize

    def _captured(self) -> str:
        return f"{len(self.graphs)} prompt CUDA graphs ({min(self.graphs, default=0)}..{self.buckets[-1]} tokens)"

    def _forward(self, t: int, graphed: bool) -> None:
        ids, positions, slots = self.tokens
        meta = AttentionMetadata(slots[:t], self.block_tables, self.seq_lens, self.cu_seqlens_q, max_seq_len=0,
                                 is_decode=False, state_slots=self.state_slots)  # the prefill kernel needs no max
        with forward_context(meta, graphed=graphed):
            hidden = self.model(ids[:t], positions[:t])
            self.model.compute_logits(hidden[self.logits_rows], out=self.logits)

    def fits(self, step: StepInputs) -> bool:
        """A prompt-only step (its first entry takes more than one token) of few sequences and tokens."""
        return (not step.is_decode and step.num_decodes == 0 and step.num_seqs <= MAX_SEQS
                and step.num_tokens <= self.buckets[-1])

    def stage(self, step: StepInputs, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> int:
        """Copy one step's inputs into the static buffers, padded, then the tokens still on the device (feed)
        into its input ids; -> the bucket to replay. A chunk that samples nothing still writes its K/V."""
        total = step.num_tokens
        t = self.bucket(total)
        padded = np.zeros((3, t), dtype=np.int64)
        padded[2] = -1  # padding tokens write nowhere
        padded[:, :total] = step.tokens
        ints = self.chunks.host()
        self.chunks.pack(ints, step.seq_lens, step.cu, step.tables)
        rows = np.zeros(MAX_SEQS, dtype=np.int64)
        rows[: len(step.logits_rows)] = step.logits_rows
        self.tokens[:, :t].copy_(torch.from_numpy(padded), non_blocking=True)
        self.chunks.upload(ints)
        self.logits_rows.copy_(torch.from_numpy(rows), non_blocking=True)
        if self.state_slots is not None:
            state_slots = np.full(MAX_SEQS, -1, dtype=np.int32)
            state_slots[: step.num_seqs] = step.state_slots
            self.state_slots.copy_(torch.from_numpy(state_slots), non_blocking=True)
        if feed is not None:
            feed_device_tokens(self.tokens[0, :total], feed)
        return t

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)


class ChunkInts:
    """Up to max_seqs prompt chunks' seq lens, query offsets and block tables in one int32 device buffer (one
    host-to-device copy a step), after `lead` int32s its owner keeps for itself. Each part starts 16-byte
    aligned: Triton compiles a kernel variant per pointer alignment."""

    def __init__(self, lead: int, max_blocks_per_seq: int, device: torch.device, max_seqs: int = MAX_SEQS):
        self.max_seqs = s = max_seqs
        self.width = align4(max_blocks_per_seq)
        self.lens_at = align4(lead)
        self.cu_at = self.lens_at + align4(s)
        self.tables_at = self.cu_at + align4(s + 1)
        self.data = torch.zeros(self.tables_at + s * self.width, dtype=torch.int32, device=device)
        self.seq_lens = self.data[self.lens_at : self.lens_at + s]
        self.cu_seqlens_q = self.data[self.cu_at : self.cu_at + s + 1]
        self.block_tables = self.data[self.tables_at :].view(s, self.width)

    def host(self) -> np.ndarray:
        return np.zeros(self.data.shape[0], dtype=np.int32)

    def pack(self, ints: np.ndarray, seq_lens: np.ndarray, cu: np.ndarray, tables: np.ndarray) -> None:
        """Write the chunks (query offsets from 0) into the host copy ints, padded to max_seqs."""
        n, s = len(seq_lens), self.max_seqs
        ints[self.lens_at : self.lens_at + n] = seq_lens  # padding sequences: no keys ...
        ints[self.cu_at : self.cu_at + s + 1] = cu[-1]  # ... and no queries
        ints[self.cu_at : self.cu_at + n + 1] = cu
        ints[self.tables_at :].reshape(s, self.width)[:n, : tables.shape[1]] = tables

    def upload(self, ints: np.ndarray) -> None:
        self.data.copy_(torch.from_numpy(ints), non_blocking=True)


def align4(n: int) -> int:
    """n rounded up to a multiple of 4: int32 parts that start there are 16-byte aligned."""
    return -(-n // 4) * 4
