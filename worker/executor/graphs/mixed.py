"""Steps that mix decodes with small prompt chunks as CUDA graphs: one graph per (decode rows, prompt tokens) pair.

Run eagerly, such a step launches about 400 kernels from Python, and on the H200 the host took 18-32 ms a
step whatever its size, against 5.7-16 ms of GPU time for 16-64 decodes beside 64-512 prompt tokens
(benchmarks/mixed_step_bench.py). Every running sequence waits for that step: a prompt that arrives while
others decode (most prompts, on a server) stalled them all for the host's time, not the GPU's.

A step of at most MAX_SEQS prompt chunks (up to the largest prompt graph's tokens in all) behind up to
DECODE_SIZES[-1] decodes is laid out as [decode rows, padded to a decode size][prompt tokens, padded to a token bucket].
Padding decode rows see one key and write nowhere, as in the decode graphs; padding tokens write nowhere
and padding prompt sequences own no tokens, as in the prompt graphs. The decodes go through the decode
kernel and the chunks through the prefill kernel, as in an eager mixed step, and the lm_head runs inside
the graph on the rows that sample.

With these graphs a small token budget no longer starves the GPU: under `--max-num-batched-tokens 1024`
the serving load kept the H200 97-98 % busy (eager: 76-90 %), and its median time to first token was
54-80 % below the 8,192 budget's at the same throughput (docs/benchmarks.md, run U).
"""

from __future__ import annotations

import numpy as np
import torch

from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.executor.graphs.decode import capture_each
from pagefleet.worker.executor.graphs.prompt import MAX_SEQS, ChunkInts, token_buckets

DECODE_SIZES = (8, 16, 32, 64)  # a padding decode row costs a GEMM row and one key: coarse sizes are cheap
TOKEN_BUCKETS = (64, 128, 256, 384, 512, 640, 768, 1024)  # 640: a 564-token prompt; 32 graphs: 1.3 s to capture on the H200


def graph_keys(max_num_seqs: int, max_tokens: int) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of each graph, prompt tokens up to max_tokens (the largest prompt graph's
    bucket). A mixed step holds at most max_num_seqs - 1 decodes."""
    sizes = sorted({min(d, max_num_seqs) for d in DECODE_SIZES})
    return [(d, t) for d in sizes for t in TOKEN_BUCKETS if t <= max_tokens]


def mixed_graph_bytes(activation_peak: int, max_num_seqs: int, max_num_batched_tokens: int, vocab_size: int,
                      dtype: torch.dtype) -> int:
    """What the mixed graphs add to the prompt graphs' reserve: their static logits, and the activations of
    the rows their padded decodes put past the largest prompt graph's (at the profiled step's rate a token)."""
    buckets = token_buckets(max_num_batched_tokens)
    keys = graph_keys(max_num_seqs, buckets[-1]) if buckets else []
    if not keys:
        return 0
    extra_rows = max(d + t for d, t in keys) - buckets[-1]
    return (activation_peak * extra_rows // max_num_batched_tokens
            + (min(DECODE_SIZES[-1], max_num_seqs) + MAX_SEQS) * vocab_size * dtype.itemsize)


class MixedGraphs:
    def __init__(self, model, device: torch.device, keys: list[tuple[int, int]], max_model_len: int, max_blocks_per_seq: int):
        self.model = model
        self.keys = keys
        self.decode_sizes = sorted({d for d, _ in keys})
        self.max_model_len = max_model_len
        d, t, s = self.decode_sizes[-1], max(t for _, t in keys), MAX_SEQS
        self.tokens = torch.zeros(3, d + t, dtype=torch.long, device=device)  # input ids, positions, slots
        self.tokens[2].fill_(-1)
        # The decodes' seq lens lead the prompt chunks' int32 buffer (one host-to-device copy a step). Their
        # block tables stand apart: a step copies only its own rows and columns of them (64 full rows are
        # 512 KB at a 32k-token max_model_len), as the decode graphs do.
        self.chunks = chunks = ChunkInts(d, max_blocks_per_seq, device)
        self.dec_seq_lens = chunks.data[:d]
        self.dec_tables = torch.zeros(d, chunks.width, dtype=torch.int32, device=device)
        self.seq_lens, self.cu_seqlens_q, self.block_tables = chunks.seq_lens, chunks.cu_seqlens_q, chunks.block_tables
        self.logits_rows = torch.zeros(d + s, dtype=torch.long, device=device)
        self.logits = torch.empty(d + s, model.lm_head.weight.shape[0], dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # mixed steps run as a graph (tests, benchmarks)

    def fits(self, num_decodes: int, num_prompts: int, prompt_tokens: int) -> bool:
        return (0 < num_decodes <= self.decode_sizes[-1] and 0 < num_prompts <= MAX_SEQS
                and self._key(num_decodes, prompt_tokens) is not None)

    @torch.inference_mode()
    def capture(self, share: tuple[int, int] | None = None, pool=None) -> None:
        """share (i, n): a compile worker's slice. pool: the decode graphs' memory pool (one graph runs at a time)."""
        self.graphs, _, self.capture_seconds = capture_each(self.keys, self._forward, self.tokens.device, share, pool)
        print(f"pagefleet: captured {len(self.graphs)} mixed CUDA graphs (decodes {self.decode_sizes[0]}..{self.decode_sizes[-1]}"
              f" beside prompt tokens {TOKEN_BUCKETS[0]}..{max(t for _, t in self.keys)}) in {self.capture_seconds:.1f}s", flush=True)

    def _forward(self, key: tuple[int, int], graphed: bool) -> None:
        d, t = key
        ids, positions, slots = self.tokens
        meta = AttentionMetadata(
            slot_mapping=slots[: d + t], block_tables=self.dec_tables[:d], seq_lens=self.dec_seq_lens[:d],
            cu_seqlens_q=self.cu_seqlens_q, max_seq_len=self.max_model_len, is_decode=False, num_decodes=d,
            prefill_block_tables=self.block_tables, prefill_seq_lens=self.seq_lens, prefill_cu_seqlens_q=self.cu_seqlens_q)
        with forward_context(meta, graphed=graphed):
            hidden = self.model(ids[: d + t], positions[: d + t])
            self.model.compute_logits(hidden[self.logits_rows], out=self.logits)

    def stage(self, tokens: np.ndarray, seq_lens: np.ndarray, cu: np.ndarray, tables: np.ndarray, logits_rows: list[int],
              num_decodes: int) -> tuple[tuple[int, int], np.ndarray]:
        """Copy one step's inputs (decodes first, as the scheduler orders them) into the static buffers, padded;
        -> (the graph to replay, each unpadded token row's row in the padded layout)."""
        nd, total = num_decodes, tokens.shape[1]
        d, t = key = self._key(nd, total - nd)
        moved = np.arange(total)
        moved[nd:] += d - nd  # the prompt tokens start after the padded decode rows
        padded = np.zeros((3, d + t), dtype=np.int64)
        padded[2] = -1  # padding rows and tokens write nowhere
        padded[:, moved] = tokens
        ints = self.chunks.host()
        ints[:nd] = seq_lens[:nd]
        ints[nd : self.decode_sizes[-1]] = 1  # a padding decode row sees one key (of whatever block its row holds)
        self.chunks.pack(ints, seq_lens[nd:], cu[nd:] - cu[nd], tables[nd:])
        rows = np.zeros(self.logits_rows.shape[0], dtype=np.int64)
        rows[: len(logits_rows)] = moved[logits_rows]
        self.tokens[:, : d + t].copy_(torch.from_numpy(padded), non_blocking=True)
        self.chunks.upload(ints)
        self.dec_tables[:nd, : tables.shape[1]].copy_(torch.from_numpy(tables[:nd]), non_blocking=True)
        self.logits_rows.copy_(torch.from_numpy(rows), non_blocking=True)
        return key, moved

    def replay(self, key: tuple[int, int], num_rows: int) -> torch.Tensor:
        """Run the staged step; -> logits [num_rows, vocab] (a view of the static buffer, valid until the next replay)."""
        self.graphs[key].replay()
        self.replays += 1
        return self.logits[:num_rows]

    def _key(self, num_decodes: int, prompt_tokens: int) -> tuple[int, int] | None:
        d = next((s for s in self.decode_sizes if s >= num_decodes), None)
        return next(((d, t) for dd, t in self.keys if dd == d and t >= prompt_tokens), None)
