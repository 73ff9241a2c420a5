"""Steps that mix decodes with small prompt chunks as CUDA graphs: one per (decode rows, prompt tokens) pair.

Run eagerly, such a step launches about 400 kernels from Python, and on the H200 the host takes 18-32 ms a
step whatever its size, against 5.7-16 ms of GPU time for 16-64 decodes beside 64-512 prompt tokens
(docs/benchmarks.md, a mixed step's cost). Every running sequence waits for that step: a prompt that arrives
while others decode (most prompts, on a server) stalls them all for the host's time, not the GPU's.

A step of at most MAX_CHUNKS prompt chunks (up to the largest prompt graph's tokens in all) behind up to
DECODE_SIZES[-1] decodes is laid out as [decode rows, padded to a decode size][prompt tokens, padded to a token
bucket]. Padding decode rows see one key and write nowhere, as in the decode graphs; padding tokens write
nowhere and padding prompt sequences own no tokens, as in the prompt graphs. The decodes go through the decode
kernel and the chunks through the prefill kernel, as in an eager mixed step, and the lm_head runs inside
the graph on the rows that sample.

With these graphs a small token budget no longer starves the GPU: under `--max-num-batched-tokens 1024`
the serving load keeps the H200 97-98 % busy (eager: 76-90 %), and its median time to first token is
54-80 % below the 8,192 budget's at the same throughput (docs/benchmarks.md, the serving load under token
budgets 8,192-640).
"""

from __future__ import annotations

import numpy as np
import torch

from pagefleet.worker.executor.graphs.base import StepGraphs
from pagefleet.worker.executor.graphs.prompt import ChunkInts, token_buckets
from pagefleet.worker.executor.state_cache import is_stateful
from pagefleet.worker.executor.step_inputs import StepInputs, feed_device_tokens
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata

DECODE_SIZES = (8, 16, 32, 64)  # a padding decode row costs a GEMM row and one key: coarse sizes are cheap
# 640: a 564-token prompt; 32 graphs: 1.3 s to capture on the H200
TOKEN_BUCKETS = (64, 128, 256, 384, 512, 640, 768, 1024)
# Chunks beside the decodes: a prompt or two arriving, and the forced tokens of structured outputs' jump-forward
# (engine/step.py), which at concurrency 64 puts 8-16 short chunks in most steps. A padding chunk owns no query
# tile of the prefill kernel, so the spare ones cost a program launch each.
MAX_CHUNKS = 16


def graph_keys(max_num_seqs: int, max_tokens: int) -> list[tuple[int, int]]:
    """(decode rows, prompt tokens) of each graph, prompt tokens up to max_tokens (the largest prompt graph's
    bucket). A mixed step holds at most max_num_seqs - 1 decodes."""
    sizes = sorted({min(d, max_num_seqs) for d in DECODE_SIZES})
    return [(d, t) for d in sizes for t in TOKEN_BUCKETS if t <= max_tokens]


def config_keys(config) -> list[tuple[int, int]]:
    """The graph keys these settings call for: none without prompt graphs."""
    buckets = token_buckets(config.max_num_batched_tokens)
    return graph_keys(config.max_num_seqs, buckets[-1]) if buckets else []


class MixedGraphs(StepGraphs):
    def __init__(self, model, device: torch.device, keys: list[tuple[int, int]], max_model_len: int,
                 max_blocks_per_seq: int):
        super().__init__(model, keys)
        self.decode_sizes = sorted({d for d, _ in keys})
        self.max_model_len = max_model_len
        d, t, s = self.decode_sizes[-1], max(t for _, t in keys), MAX_CHUNKS
        self.max_chunks = s
        self.tokens = torch.zeros(3, d + t, dtype=torch.long, device=device)  # input ids, positions, slots
        self.tokens[2].fill_(-1)
        # The decodes' seq lens lead the prompt chunks' int32 buffer (one host-to-device copy a step). Their
        # block tables stand apart: a step copies only its own rows and columns of them (64 full rows are
        # 512 KB at a 32k-token max_model_len), as the decode graphs do.
        self.chunks = chunks = ChunkInts(d, max_blocks_per_seq, device, s)
        self.dec_seq_lens = chunks.data[:d]
        self.dec_tables = torch.zeros(d, chunks.width, dtype=torch.int32, device=device)
        self.seq_lens, self.cu_seqlens_q, self.block_tables = chunks.seq_lens, chunks.cu_seqlens_q, chunks.block_tables
        self.logits_rows = torch.zeros(d + s, dtype=torch.long, device=device)
        self.logits = torch.empty(d + s, model.lm_head.weight.shape[0], dtype=model.lm_head.weight.dtype, device=device)
        # A model with recurrent state: the decodes' state slots end where the prompt chunks' begin (at d), so
        # the graph of d' decodes reads its d' + MAX_CHUNKS slots as one view ending there; -1 on padding.
        self.state_slots = torch.full((d + s,), -1, dtype=torch.int32, device=device) if is_stateful(model) else None

    @classmethod
    def for_config(cls, model, device, config, max_model_len: int, max_blocks_per_seq: int) -> MixedGraphs | None:
        """None: no prompt graphs, so no mixed ones either."""
        keys = config_keys(config)
        return cls(model, device, keys, max_model_len, max_blocks_per_seq) if keys else None

    @staticmethod
    def reserve_bytes(config, vocab_size: int, dtype: torch.dtype, activation_peak: int) -> int:
        """What the mixed graphs add to the prompt graphs' reserve: their static logits, and the activations of
        the rows their padded decodes put past the largest prompt graph's (at the profiled step's rate a token)."""
        keys = config_keys(config)
        if not keys:
            return 0
        extra_rows = max(d + t for d, t in keys) - token_buckets(config.max_num_batched_tokens)[-1]
        return (activation_peak * extra_rows // config.max_num_batched_tokens
                + (min(DECODE_SIZES[-1], config.max_num_seqs) + MAX_CHUNKS) * vocab_size * dtype.itemsize)

    def _captured(self) -> str:
        return (f"{len(self.graphs)} mixed CUDA graphs (decodes {self.decode_sizes[0]}..{self.decode_sizes[-1]}"
                f" beside prompt tokens {TOKEN_BUCKETS[0]}..{max(t for _, t in self.keys)})")

    def _forward(self, key: tuple[int, int], graphed: bool) -> None:
        d, t = key
        ids, positions, slots = self.tokens
        meta = AttentionMetadata(
            slot_mapping=slots[: d + t], block_tables=self.dec_tables[:d], seq_lens=self.dec_seq_lens[:d],
            cu_seqlens_q=self.cu_seqlens_q, max_seq_len=self.max_model_len, is_decode=False, num_decodes=d,
            prefill_block_tables=self.block_tables, prefill_seq_lens=self.seq_lens,
            prefill_cu_seqlens_q=self.cu_seqlens_q, state_slots=self._state_view(d))
        with forward_context(meta, graphed=graphed):
            hidden = self.model(ids[: d + t], positions[: d + t])
            self.model.compute_logits(hidden[self.logits_rows], out=self.logits)

    def fits(self, step: StepInputs) -> bool:
        """A few decodes ahead of a few prompt chunks. A one-token chunk mid-prompt counts as a decode."""
        nd = step.num_decodes
        return (0 < nd <= self.decode_sizes[-1] and 0 < step.num_seqs - nd <= self.max_chunks
                and self._key(nd, step.num_tokens - nd) is not None)

    def stage(self, step: StepInputs, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> tuple[int, int]:
        """Copy one step's inputs (decodes first, as the scheduler orders them) into the static buffers, padded,
        then the tokens still on the device (feed) into its input ids, each at its padded row; -> the graph to
        replay."""
        nd, total, tables = step.num_decodes, step.num_tokens, step.tables
        d, t = key = self._key(nd, total - nd)
        moved = np.arange(total)  # each unpadded token row's row in the padded layout
        moved[nd:] += d - nd  # the prompt tokens start after the padded decode rows
        padded = np.zeros((3, d + t), dtype=np.int64)
        padded[2] = -1  # padding rows and tokens write nowhere
        padded[:, moved] = step.tokens
        ints = self.chunks.host()
        ints[:nd] = step.seq_lens[:nd]
        ints[nd : self.decode_sizes[-1]] = 1  # a padding decode row sees one key (of whatever block its row holds)
        self.chunks.pack(ints, step.seq_lens[nd:], step.cu[nd:] - step.cu[nd], tables[nd:])
        rows = np.zeros(self.logits_rows.shape[0], dtype=np.int64)
        rows[: len(step.logits_rows)] = moved[step.logits_rows]
        self.tokens[:, : d + t].copy_(torch.from_numpy(padded), non_blocking=True)
        self.chunks.upload(ints)
        self.dec_tables[:nd, : tables.shape[1]].copy_(torch.from_numpy(tables[:nd]), non_blocking=True)
        self.logits_rows.copy_(torch.from_numpy(rows), non_blocking=True)
        if self.state_slots is not None:
            state_slots = np.full(d + self.max_chunks, -1, dtype=np.int32)
            state_slots[:nd] = step.state_slots[:nd]
            state_slots[d : d + step.num_seqs - nd] = step.state_slots[nd:]
            self._state_view(d).copy_(torch.from_numpy(state_slots), non_blocking=True)
        if feed is not None:
            feed_rows = np.full(d + t, -1, dtype=np.int64)
            feed_rows[moved] = feed[0]
            feed_device_tokens(self.tokens[0, : d + t], (feed_rows, feed[1]))
        return key

    def _state_view(self, d: int) -> torch.Tensor | None:
        """The state slots of a graph with d decode rows: [d decodes][max_chunks prompt chunks]."""
        if self.state_slots is None:
            return None
        top = self.decode_sizes[-1]
        return self.state_slots[top - d : top + self.max_chunks]

    def _key(self, num_decodes: int, prompt_tokens: int) -> tuple[int, int] | None:
        d = next((s for s in self.decode_sizes if s >= num_decodes), None)
        return next(((d, t) for dd, t in self.keys if dd == d and t >= prompt_tokens), None)
