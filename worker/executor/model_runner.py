"""One forward step on the device: the step's tensors, the model, the sampler.

Builds input ids, positions, slot mapping and block tables from the scheduled batch, runs the model, and
samples. A pure decode step replays a CUDA graph (cuda_graphs.py), a small prompt-only step one of the
prompt graphs (prompt_graphs.py), a few decodes beside small prompt chunks one of the mixed graphs
(mixed_graphs.py); larger, LoRA and --enforce-eager steps run eagerly, on kernel variants compiled at
start-up (warmup.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.executor.graphs.decode import DecodeGraphs, batch_sizes
from pagefleet.worker.executor.kv_cache import KVCache, profile_peak_bytes, size_kv_cache
from pagefleet.worker.models.loader import build_model
from pagefleet.worker.executor.graphs.mixed import MixedGraphs, graph_keys
from pagefleet.worker.models.registry import ModelConfig
from pagefleet.worker.executor.graphs.prompt import PromptGraphs, token_buckets
from pagefleet.worker.executor.sampler import Sampler
from pagefleet.worker.core.scheduler import ScheduledBatch
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.executor.startup.warmup import warm_up

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # fastest and exact on CPU
    return _DTYPES.get(model_dtype, torch.bfloat16) if model_dtype != "float32" else torch.bfloat16


@dataclass
class PendingTokens:
    """One step's sampled tokens: on the device now, on the host once `event` has fired."""

    device: torch.Tensor
    host: torch.Tensor
    event: object | None

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # waits for this step only, not for the one launched after it
        return self.host.tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path, max_model_len: int,
                 compile_workers=None, compile_share: tuple[int, int] | None = None):
        """model_path None: random weights (a compile worker's twin, worker/executor/startup/compile_workers.py). compile_workers:
        the running CompileWorkers, waited for before the KV cache is sized. compile_share (i, n): a compile
        worker's slice of the warm-up steps and graph captures."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            # Oversubscribed OpenMP threads spin and slow small GEMMs several-fold: leave cores free.
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
        ops.use_triton(self.device.type == "cuda")
        start = time.time()
        self.model = build_model(model_config, model_path, self.dtype, self.device)
        if (self.device.type == "cuda" and not config.enforce_eager and not config.enable_lora
                and self.dtype in (torch.bfloat16, torch.float16)):
            # decode graphs then launch no per-layer norm (LlamaForCausalLM.forward_folded); before FP8
            # quantisation, so the scales cover the folded weights
            self.model.fold_norms()
        if config.quantization == "fp8":
            from pagefleet.worker.models.layers.fp8 import quantize_model_fp8

            quantize_model_fp8(self.model, self.device)
        # seconds of each start-up phase, for the engine's start-up line and a compile worker's report
        self.start_seconds = {"load": time.time() - start, "workers": 0.0, "warmup": 0.0, "graphs": 0.0}
        self.lora = None
        if config.enable_lora:  # before the KV cache is sized, so the budget counts the adapter slots
            from pagefleet.worker.models.layers.lora import LoRAManager

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device)
        self.sampler = Sampler(self.device, config.seed, model_config.eos_token_ids)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        if compile_workers is not None:  # before measuring free memory: they hold some while they run
            start = time.time()
            compile_workers.wait()
            self.start_seconds["workers"] = time.time() - start
        if compile_share is not None and compile_share[0] == 0 and self.device.type == "cuda":
            profile_peak_bytes(self, config)  # a worker's blocks are fixed, but this step's kernels are the engine's
        num_blocks = size_kv_cache(self, config, model_config)
        self.kv = KVCache(model_config, num_blocks, self.block_size, self.dtype, self.device)
        self.kv.bind(self.model)
        self.graphs: DecodeGraphs | None = None  # None: every step eager (--enforce-eager, CPU)
        self.prompt_graphs: PromptGraphs | None = None  # None: every prompt step eager
        self.mixed_graphs: MixedGraphs | None = None  # None: every step mixing decodes and prompts eager
        if self.device.type == "cuda":
            warm_up(self, compile_share)
            if not config.enforce_eager:
                self.graphs = DecodeGraphs(self.model, self.device, batch_sizes(config.max_num_seqs), max_model_len,
                                           self.max_blocks_per_seq)
                self.graphs.capture(compile_share)
                self.start_seconds["graphs"] = self.graphs.capture_seconds
                buckets = token_buckets(config.max_num_batched_tokens)
                if buckets:
                    self.prompt_graphs = PromptGraphs(self.model, self.device, buckets, self.max_blocks_per_seq)
                    self.prompt_graphs.capture(compile_share, self.graphs.pool)
                    self.start_seconds["graphs"] += self.prompt_graphs.capture_seconds
                    keys = graph_keys(config.max_num_seqs, buckets[-1])
                    if keys:
                        self.mixed_graphs = MixedGraphs(self.model, self.device, keys, max_model_len, self.max_blocks_per_seq)
                        self.mixed_graphs.capture(compile_share, self.graphs.pool)
                        self.start_seconds["graphs"] += self.mixed_graphs.capture_seconds
            if compile_workers is not None:
                compile_workers.mark_warm()

    # ---- step

    def prepare(self, batch: ScheduledBatch):
        """Host arrays for one step: [3, T] int64 (input ids, positions, slots), seq lens, query offsets,
        block tables [n, width] int32, and the rows whose logits are sampled.

        Per-sequence work is kept to list reads; the arithmetic runs in numpy over the whole step,
        because at 512 sequences a Python loop per token or per table row costs milliseconds."""
        bs = self.block_size
        seqs = batch.seqs
        n = len(seqs)
        counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        ends = starts + counts
        cu = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        if total == n:  # pure decode: the hot path, one token per sequence
            ids = [s.token_ids[p] for s, p in zip(seqs, starts.tolist())]
            pos = starts
            row = np.arange(n)
        else:
            ids = list(chain.from_iterable(s.token_ids[a:e] for s, a, e in zip(seqs, starts.tolist(), ends.tolist())))
            row = np.repeat(np.arange(n), counts)
            pos = np.arange(total) - np.repeat(cu[:-1].astype(np.int64), counts) + np.repeat(starts, counts)
        widths = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        tables = np.zeros((n, -(-int(widths.max()) // 4) * 4), dtype=np.int32)  # rows 16-byte aligned
        tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
            chain.from_iterable(s.block_table for s in seqs), dtype=np.int32, count=int(widths.sum()))
        slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
        # a row samples when its prompt is done (or it is a decode); a prompt chunk that is not the last does not
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=n)
        logits_rows = (cu[1:] - 1)[ends == num_tokens].tolist()
        tokens = np.stack([np.asarray(ids, dtype=np.int64), pos, slots])
        return tokens, ends.astype(np.int32), cu, tables, logits_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward the scheduled tokens; returns logits [rows, vocab] for the sequences that sample (None if none do).

        feed = (rows, tokens): sequences whose last token is still on the device (an overlapped step)
        take input id tokens[rows[i]] where rows[i] >= 0.
        """
        if batch.copies:
            self.kv.copy_blocks(batch.copies)
        tokens, seq_lens, cu, tables, logits_rows = self.prepare(batch)
        n = len(batch.seqs)
        is_decode = tokens.shape[1] == n
        lora_mapping = self.lora.mapping(batch.seqs, batch.num_new_tokens) if self.lora is not None else None
        if is_decode and self.graphs is not None and self.graphs.fits(n) and lora_mapping is None:
            input_ids = self.graphs.stage(tokens, seq_lens, tables)
            if feed is not None:
                self._feed_device_tokens(input_ids, feed)
            logits = self.graphs.replay(n)  # the lm_head is in the graph: logits of every row
            return self._sampled_rows(logits, logits_rows)
        # The scheduler puts one-token entries first; attention runs them through the decode kernel.
        num_decodes = 0 if is_decode else next((i for i, k in enumerate(batch.num_new_tokens) if k != 1), n)
        pg = self.prompt_graphs
        if not is_decode and num_decodes == 0 and pg is not None and pg.fits(n, tokens.shape[1]) and lora_mapping is None:
            bucket = pg.stage(tokens, seq_lens, cu, tables, logits_rows)
            if feed is not None:
                self._feed_device_tokens(pg.tokens[0, : tokens.shape[1]], feed)
            logits = pg.replay(bucket, len(logits_rows))  # a prompt chunk that samples nothing still writes its K/V
            return logits if logits_rows else None
        mg = self.mixed_graphs
        if (num_decodes and mg is not None and lora_mapping is None
                and mg.fits(num_decodes, n - num_decodes, tokens.shape[1] - num_decodes)):
            key, moved = mg.stage(tokens, seq_lens, cu, tables, logits_rows, num_decodes)
            if feed is not None:  # the feed's rows follow the tokens to their padded rows
                rows = np.full(sum(key), -1, dtype=np.int64)
                rows[moved] = feed[0]
                self._feed_device_tokens(mg.tokens[0, : sum(key)], (rows, feed[1]))
            logits = mg.replay(key, len(logits_rows))  # a 1-token chunk mid-prompt counts as a decode and samples nothing
            return logits if logits_rows else None
        # larger mixed and prompt steps, LoRA and over-sized steps: eager
        tokens_d = self._upload_rows(tokens)
        meta = self._eager_metadata(tokens_d[2], tables, seq_lens, cu, num_decodes, is_decode)
        if feed is not None:
            self._feed_device_tokens(tokens_d[0], feed)
        with forward_context(meta, lora_mapping):
            hidden = self.model(tokens_d[0], tokens_d[1])
        rows = self._sampled_rows(hidden, logits_rows)
        return None if rows is None else self.model.compute_logits(rows)

    def _sampled_rows(self, x: torch.Tensor, logits_rows: list[int]) -> torch.Tensor | None:
        """The rows of x (hidden states or logits) whose sequences sample; None when only unfinished
        prompt chunks ran."""
        if not logits_rows:
            return None
        if len(logits_rows) == x.shape[0]:
            return x
        return x[torch.tensor(logits_rows, dtype=torch.long, device=self.device)]

    def _eager_metadata(self, slot_mapping, tables, seq_lens, cu, num_decodes: int, is_decode: bool) -> AttentionMetadata:
        """The attention context of an eager step; the first `num_decodes` sequences have one token each."""
        block_tables = torch.from_numpy(tables).to(self.device, non_blocking=True)
        seq_lens_d, cu_d, prefill_lens_d, prefill_cu_d = self._upload_int32(
            seq_lens, cu, seq_lens[num_decodes:], cu[num_decodes:] - cu[num_decodes])
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens_d,
            cu_seqlens_q=cu_d,
            max_seq_len=int(seq_lens.max()),
            is_decode=is_decode,
            num_decodes=num_decodes,
            prefill_block_tables=block_tables[num_decodes:],  # rows of 4k int32: 16-byte aligned
            prefill_seq_lens=prefill_lens_d,
            prefill_cu_seqlens_q=prefill_cu_d,
        )

    def _upload_rows(self, tokens: np.ndarray) -> torch.Tensor:
        """[3, T] int64 on the device with each row 16-byte aligned (row stride T rounded up to even): the
        positions row feeds RoPE, and at an odd T its pointer alignment made a new compile mid-run."""
        num_tokens = tokens.shape[1]
        if num_tokens % 2:  # only an odd T needs the padded copy
            tokens = np.concatenate([tokens, np.zeros((tokens.shape[0], 1), dtype=tokens.dtype)], axis=1)
        return torch.from_numpy(tokens).to(self.device, non_blocking=True)[:, :num_tokens]

    def _upload_int32(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Several small int32 arrays in one host-to-device copy, each starting 16-byte aligned: Triton
        compiles a kernel variant per pointer alignment, and a new variant mid-run costs seconds."""
        pieces, offsets, at = [], [], 0
        for a in arrays:
            pad = -len(a) % 4
            pieces += [a.astype(np.int32, copy=False), np.zeros(pad, dtype=np.int32)]
            offsets.append(at)
            at += len(a) + pad
        flat = torch.from_numpy(np.concatenate(pieces)).to(self.device, non_blocking=True)
        return [flat[o : o + len(a)] for o, a in zip(offsets, arrays)]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        return self.sampler.sample(logits, seqs)

    def _feed_device_tokens(self, input_ids: torch.Tensor, feed) -> None:
        rows, prev = feed
        rows_d = torch.from_numpy(rows).to(self.device, non_blocking=True)
        input_ids.copy_(torch.where(rows_d >= 0, prev[rows_d.clamp(min=0)], input_ids))

    def sample_async(self, logits: torch.Tensor, seqs: list[Sequence]) -> "PendingTokens":
        """Sample without waiting: the tokens stay on the device for the next step and are copied to
        pinned host memory behind an event, so the host can prepare the next step meanwhile."""
        tokens = self.sampler.sample_on_device(logits, seqs)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(tokens, host, event)
