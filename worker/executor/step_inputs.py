"""A step's inputs: input ids, positions, slot mapping and block tables from the scheduled batch, on the device.

The host arrays are built in numpy over the whole step (per-sequence work is kept to list reads), because at 512
sequences a Python loop per token or per table row costs milliseconds. Every upload keeps the tensors it makes
16-byte aligned: Triton compiles a kernel variant per pointer alignment, and a new variant mid-run costs seconds.
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from pagefleet.worker.core.block_manager import build_tables
from pagefleet.worker.core.scheduler import ScheduledBatch
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata


class StepInputs(NamedTuple):
    """One step's host arrays; `prepare` builds them."""

    tokens: np.ndarray  # [3, T] int64: input ids, positions, slot mapping
    seq_lens: np.ndarray  # [n] int32: each sequence's length after this step
    cu: np.ndarray  # [n + 1] int32: query offsets
    tables: np.ndarray  # [n, width] int32 block tables, width a multiple of 4 (rows 16-byte aligned)
    logits_rows: list[int]  # the token rows whose sequences sample
    num_decodes: int  # one-token entries leading a step that also has prompt chunks (0 in a pure decode step)
    state_slots: np.ndarray | None = None  # [n] int32: each sequence's state slot (models with recurrent state)
    # an eager decode step whose rows share prompt blocks: shared_prefix_groups' (groups, prefix_lens)
    cascade: tuple[np.ndarray, np.ndarray] | None = None
    # prompt tokens to score (SamplingParams.prompt_logprobs): (token rows whose logits score them, the prompt
    # tokens they score, the most top entries any of them asks for)
    prompt_logprobs: tuple[np.ndarray, np.ndarray, int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_decode(self) -> bool:
        """Pure decode: one token per sequence."""
        return self.tokens.shape[1] == len(self.seq_lens)


def prepare(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """The host arrays of one step. The scheduler puts one-token entries first; attention runs them through the
    decode kernel."""
    bs = block_size
    seqs = batch.seqs
    n = len(seqs)
    counts = np.asarray(batch.num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
    ends = starts + counts
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    if total == n:  # pure decode: the hot path, one token per sequence
        ids = [s.token_ids[p] for s, p in zip(seqs, starts.tolist(), strict=True)]
        pos = starts
        row = np.arange(n)
        num_decodes = 0
    else:
        ids = list(chain.from_iterable(s.token_ids[a:e]
                                       for s, a, e in zip(seqs, starts.tolist(), ends.tolist(), strict=True)))
        row = np.repeat(np.arange(n), counts)
        pos = np.arange(total) - np.repeat(cu[:-1].astype(np.int64), counts) + np.repeat(starts, counts)
        num_decodes = next((i for i, k in enumerate(batch.num_new_tokens) if k != 1), n)
    tables = batch.block_tables.build(seqs) if batch.block_tables is not None else build_tables(seqs)
    slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
    # a row samples when its prompt is done (or it is a decode); a prompt chunk that is not the last does not
    num_tokens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)  # not the property: a call
    logits_rows = (cu[1:] - 1)[ends == num_tokens].tolist()
    tokens = np.stack([np.asarray(ids, dtype=np.int64), pos, slots])
    state_slots = None
    if seqs[0].state_slot is not None:  # a model with recurrent state: every sequence holds a slot
        state_slots = np.fromiter((s.state_slot for s in seqs), dtype=np.int32, count=n)
    scored = None
    if spans := batch.prompt_logprob_spans():
        rows = np.concatenate([np.arange(cu[i] + a - starts[i], cu[i] + e - starts[i]) for i, a, e in spans])
        targets = np.fromiter(chain.from_iterable(seqs[i].token_ids[a + 1 : e + 1] for i, a, e in spans),
                              dtype=np.int64, count=len(rows))
        scored = (rows, targets, max(seqs[i].params.prompt_logprobs for i, _, _ in spans))
    return StepInputs(tokens, ends.astype(np.int32), cu, tables, logits_rows, num_decodes, state_slots,
                      prompt_logprobs=scored)


def upload_rows(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """[3, T] int64 on the device with each row 16-byte aligned (row stride T rounded up to even): the
    positions row feeds RoPE, and at an odd T its pointer alignment made a new compile mid-run."""
    num_tokens = tokens.shape[1]
    if num_tokens % 2:  # only an odd T needs the padded copy
        tokens = np.concatenate([tokens, np.zeros((tokens.shape[0], 1), dtype=tokens.dtype)], axis=1)
    return torch.from_numpy(tokens).to(device, non_blocking=True)[:, :num_tokens]


def upload_int32(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Several small int32 arrays in one host-to-device copy, each starting 16-byte aligned."""
    pieces, offsets, at = [], [], 0
    for a in arrays:
        pad = -len(a) % 4
        pieces += [a.astype(np.int32, copy=False), np.zeros(pad, dtype=np.int32)]
        offsets.append(at)
        at += len(a) + pad
    flat = torch.from_numpy(np.concatenate(pieces)).to(device, non_blocking=True)
    return [flat[o : o + len(a)] for o, a in zip(offsets, arrays, strict=True)]


def eager_metadata(device: torch.device, slot_mapping: torch.Tensor, tables: np.ndarray, seq_lens: np.ndarray,
                   cu: np.ndarray, num_decodes: int, is_decode: bool, state_slots: np.ndarray | None = None,
                   cascade: tuple[np.ndarray, np.ndarray] | None = None) -> AttentionMetadata:
    """The attention context of an eager step; the first `num_decodes` sequences have one token each.
    state_slots: each sequence's state slot (models with recurrent state), cascade: a decode step's shared-prefix
    groups and prefix lengths; both uploaded with the other int32s."""
    block_tables = torch.from_numpy(tables).to(device, non_blocking=True)
    extra = () if state_slots is None else (state_slots,)
    if cascade is not None:
        extra += (cascade[0].reshape(-1), cascade[1])
    seq_lens_d, cu_d, prefill_lens_d, prefill_cu_d, *extra_d = upload_int32(
        device, seq_lens, cu, seq_lens[num_decodes:], cu[num_decodes:] - cu[num_decodes], *extra)
    cascade_d = None
    if cascade is not None:
        groups_d, prefix_lens_d = extra_d[-2:]
        cascade_d = (groups_d.view(-1, 3), prefix_lens_d)
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
        state_slots=extra_d[0] if state_slots is not None else None,
        cascade=cascade_d,
    )


def feed_device_tokens(input_ids: torch.Tensor, feed: tuple[np.ndarray, torch.Tensor]) -> None:
    """feed = (rows, tokens): input id i becomes tokens[rows[i]] where rows[i] >= 0 (a sequence whose last token
    is still on the device, in an overlapped step)."""
    rows, prev = feed
    n = len(rows)
    if n == len(prev) == len(input_ids) and rows[0] == 0 and np.array_equal(rows, np.arange(n)):
        # the steady decode step: every row takes the token it sampled last step, one copy instead of an upload
        # and four gathers (a 256-row rollout step of a small model is bound by such launches)
        input_ids.copy_(prev)
        return
    rows_d = torch.from_numpy(rows).to(input_ids.device, non_blocking=True)
    input_ids.copy_(torch.where(rows_d >= 0, prev[rows_d.clamp(min=0)], input_ids))


def sampled_rows(x: torch.Tensor, logits_rows: list[int]) -> torch.Tensor:
    """The rows of x (hidden states or logits) whose sequences sample; logits_rows is not empty."""
    if len(logits_rows) == x.shape[0]:
        return x
    return x[torch.tensor(logits_rows, dtype=torch.long, device=x.device)]


# Eager decode steps of this many rows or more look for rows sharing prompt blocks (kernels/cascade.py); from here
# the decode kernel runs RoPE as a launch of its own anyway (attention.ROPE_MAX_BATCH), which the cascade needs.
CASCADE_MIN_ROWS = 64


def shared_prefix_groups(tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                         samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of decode rows whose block tables start with the same blocks (the samples of one prompt, kept side by
    side by the scheduler, or prompts that hit the same cached prefix), for kernels/cascade.py.

    A run is cut into groups of at most `samples` rows. A group shares the whole blocks every row holds in the
    same places, up to the last whole block before its shortest row's newest token (that token's block is each
    row's own). -> (groups [G, 3] int32: first row, rows, prefix tokens, only groups of 2 rows or more sharing a
    block; prefix_lens [n] int32: each row's group's prefix tokens, 0 outside a group).
    """
    n = len(seq_lens)
    first = tables[:, 0]
    new_run = np.empty(n, dtype=bool)
    new_run[0] = True
    np.not_equal(first[1:], first[:-1], out=new_run[1:])
    if new_run.all():  # no two neighbours share a first block (n = 1 traffic): nothing to compare further
        return np.empty((0, 3), dtype=np.int32), np.zeros(n, dtype=np.int32)
    run_starts = np.flatnonzero(new_run)
    in_run = np.arange(n) - run_starts[np.cumsum(new_run) - 1]
    starts = np.flatnonzero(in_run % samples == 0)
    sizes = np.diff(np.append(starts, n))
    leaders = np.repeat(starts, sizes)
    same = tables == tables[leaders]
    leading = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # whole blocks each row shares with its leader
    shared = np.minimum.reduceat(leading, starts)
    limit = (np.minimum.reduceat(seq_lens, starts).astype(np.int64) - 1) // block_size
    prefix = np.minimum(shared, limit) * block_size
    keep = (sizes > 1) & (prefix > 0)
    groups = np.stack([starts[keep], sizes[keep], prefix[keep]], axis=1).astype(np.int32)
    prefix_lens = np.repeat(np.where(keep, prefix, 0), sizes).astype(np.int32)
    return groups, prefix_lens
