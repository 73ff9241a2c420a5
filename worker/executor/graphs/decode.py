"""Decode steps as CUDA graphs: one graph per captured batch size over static input buffers.

A pure decode step of n sequences is padded to the next captured size: its inputs are copied into the
static buffers (padding rows write to slot -1, i.e. nowhere, and see one key), then the graph replays the
whole model forward and the lm_head in one launch. `--enforce-eager` skips all of this.

Every graph writes its logits into one static buffer [max batch, vocab] (a buffer per graph would cost
2 GB at 512 sequences): a replay's logits are read by the sampling launches queued behind it, before the
next replay on the same stream overwrites them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.executor.startup.compile_workers import share_of


def batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (at most 512), and max_num_seqs itself."""
    top = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def static_logits_bytes(model_config, max_num_seqs: int, dtype: torch.dtype) -> int:
    """The graphs' shared logits buffer, which the KV budget must leave room for."""
    return batch_sizes(max_num_seqs)[-1] * model_config.vocab_size * dtype.itemsize


def capture_each(keys, forward, device, share=None, pool=None) -> tuple[dict, object, float]:
    """A CUDA graph of forward(key) for each key, largest first so that the smaller ones reuse its memory,
    all in one memory pool (only one graph runs at a time); each after one run outside the capture, where
    Triton compiles (forward(key, graphed): graphed only inside the capture). share (i, n): only every n-th key from the i-th (a compile worker's slice, which wants
    the kernels compiled, not the graphs). -> (graph by key, the pool, seconds taken)."""
    start = time.time()
    ops.reserve_arrivals(device)  # split GEMVs and the attention merge count arrivals in them
    keys = sorted(keys)
    graphs = {}
    for key in reversed(share_of(keys, share)):
        forward(key, False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            forward(key, True)
        pool = graph.pool() if pool is None else pool
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, pool, time.time() - start


class DecodeGraphs:
    def __init__(self, model, device: torch.device, sizes: list[int], max_model_len: int, max_blocks_per_seq: int):
        self.model = model
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool, which the prompt and mixed graphs share (one graph runs at a time)
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self, share: tuple[int, int] | None = None) -> None:
        """share (i, n): capture only every n-th size from the i-th (a compile worker's slice, which wants the
        kernels compiled, not the graphs; the buffers keep the full sizes so the variants match)."""
        self.graphs, self.pool, self.capture_seconds = capture_each(self.sizes, self._forward, self.tokens.device, share)
        print(f"pagefleet: captured {len(self.sizes)} decode CUDA graphs (batch 1..{self.max_batch}) in "
              f"{self.capture_seconds:.1f}s", flush=True)

    def _forward(self, bs: int, graphed: bool) -> None:
        ids, positions, slots = self.tokens
        meta = AttentionMetadata(slots[:bs], self.block_tables[:bs], self.seq_lens[:bs], self.cu_seqlens_q[: bs + 1],
                                 self.max_model_len, True)
        with forward_context(meta, graphed=graphed):
            self.model.compute_logits(self.model(ids[:bs], positions[:bs]), out=self.logits[:bs])

    def fits(self, n: int) -> bool:
        return n <= self.max_batch

    def stage(self, tokens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Copy one step's inputs into the static buffers; -> the step's input ids (for tokens still on
        the device to be written in before the replay)."""
        n = tokens.shape[1]
        bs = self._padded(n)
        self.tokens[:, :n].copy_(torch.from_numpy(tokens), non_blocking=True)
        self.tokens[2, n:bs].fill_(-1)  # padding rows write nowhere
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, : tables.shape[1]].copy_(torch.from_numpy(tables), non_blocking=True)
        return self.tokens[0, :n]

    def replay(self, n: int) -> torch.Tensor:
        """Run the staged step; -> logits [n, vocab] (a view of the static buffer, valid until the next replay)."""
        self.graphs[self._padded(n)].replay()
        return self.logits[:n]

    def _padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)
