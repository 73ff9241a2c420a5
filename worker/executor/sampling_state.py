"""Per-sequence sampling state: each sequence's row record on the host, its penalty slot on the device.

A sequence joins when it first samples and leaves when the engine forgets it (finish or abort; a preempted
sequence keeps both, so its counts and its seed's position carry on). Its record (kernels/reference.py's
row layout, then the penalty fields below) is written once at join into a host table; a step gathers its
rows from there with numpy, sets the output positions, and the sampler copies them to the device in one
pinned copy. Per-step records rather than a device table: a record is 64 bytes, so copying a step's rows
costs the one copy a row-to-slot index would, and nothing on the device has to follow joins and leaves
across overlapped steps.

A sequence with penalties, logit_bias, allowed_token_ids, one-token bad_words or min_tokens also gets a device
slot: one int32 word per vocabulary entry (its output count, plus PROMPT_BIT for a prompt token, marked once at
join, for the repetition penalty, and OUTSIDE_BIT for a token allowed_token_ids leaves out or a bad word bans),
its logit_bias entries and its min_tokens-banned ids. The sampler adds each sampled token to its slot's counts
on the device, so penalties never need the output on the host. A slot is 512 KiB at a 128k vocabulary; the
first sequence that needs one allocates max_num_seqs of them, which the KV budget leaves room for
(penalty_slot_bytes, executor/memory.py). Past that, only preempted sequences holding their slots while
others run: the slots then grow by doubling.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from pagefleet.kernels import reference as ref
from pagefleet.worker.core.sequence import Sequence

# the record: kernels/reference.py's sampling fields (0 .. 7), then these
SLOT, MIN_TOKENS, REPETITION, PRESENCE, FREQUENCY = 8, 9, 10, 11, 12
ROW = 16  # int32 per record: rows stay 16-byte aligned
PROMPT_BIT = 1 << 30  # a prompt token's mark in its slot word; the low bits count the outputs
OUTSIDE_BIT = 1 << 29  # a token outside the sequence's allowed_token_ids: never drawn
COUNT_MASK = OUTSIDE_BIT - 1
SEEN_MASK = PROMPT_BIT | COUNT_MASK  # in the prompt or the outputs: the repetition penalty's tokens


def needs_slot(seq: Sequence) -> bool:
    p = seq.params
    return _uses_penalties(seq) or p.min_tokens > 0


def _uses_penalties(seq: Sequence) -> bool:
    """Processed every step (min_tokens alone only until it is reached)."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or bool(p.allowed_token_ids) or bool(single_token_bans(seq)))


def single_token_bans(seq: Sequence) -> list[int]:
    """bad_words of one token: never drawn, marked OUTSIDE_BIT in the slot like a token allowed_token_ids leaves out."""
    return [ids[0] for ids in seq.params.bad_words_token_ids or () if len(ids) == 1]


def bad_word_sequences(seq: Sequence) -> list[list[int]]:
    """bad_words of several tokens: the last is banned in a step whose output ends with the others."""
    return [ids for ids in seq.params.bad_words_token_ids or () if len(ids) > 1]


def penalty_slot_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """The slots' words for max_num_seqs sequences, which the KV budget leaves free."""
    return max_num_seqs * vocab_size * 4


class PenaltySlots:
    """The device slots: words int32 [S, V], bias ids/values [S, NB], banned ids [S, NBAN]; `rows` of them at
    first, grown by doubling past that."""

    def __init__(self, device: torch.device, vocab_size: int, rows: int):
        self.device, self.vocab_size, self.rows = device, vocab_size, rows
        self.words = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.bias_ids = torch.zeros(0, 1, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(0, 1, dtype=torch.float32, device=device)
        self.banned = torch.zeros(0, 1, dtype=torch.int64, device=device)
        self.free: list[int] = []

    def _grow(self, rows: int, bias_width: int, banned_width: int) -> None:
        def grown(t: torch.Tensor, width: int) -> torch.Tensor:
            new = torch.zeros(max(rows, t.shape[0]), max(width, t.shape[1]), dtype=t.dtype, device=self.device)
            new[: t.shape[0], : t.shape[1]] = t
            return new

        old = self.words.shape[0]
        self.words = grown(self.words, self.vocab_size)
        self.bias_ids, self.bias_values = grown(self.bias_ids, bias_width), grown(self.bias_values, bias_width)
        # a banned row is padded with its own first id (banning it twice changes nothing): widening repeats it
        banned = grown(self.banned, banned_width)
        if banned.shape[1] > self.banned.shape[1] and old:
            banned[:old, self.banned.shape[1]:] = self.banned[:, :1]
        self.banned = banned
        self.free += range(self.words.shape[0] - 1, old - 1, -1)

    def join(self, seq: Sequence, banned: list[int]) -> int:
        """A slot for seq: its prompt marked, outputs so far counted, tokens outside its allowed_token_ids marked,
        its logit_bias and banned ids written."""
        bias = seq.params.logit_bias or {}
        if not self.free or len(bias) > self.bias_ids.shape[1] or len(banned) > self.banned.shape[1]:
            rows = 2 * self.words.shape[0] if self.words.shape[0] else self.rows
            self._grow(rows if not self.free else self.words.shape[0], len(bias), len(banned))
        slot = self.free.pop()
        dev = self.device
        words = self.words[slot]
        allowed = seq.params.allowed_token_ids
        words.fill_(OUTSIDE_BIT if allowed else 0)
        if allowed:
            words[torch.tensor(allowed, dtype=torch.long, device=dev)] = 0
        if bans := single_token_bans(seq):
            words[torch.tensor(bans, dtype=torch.long, device=dev)] |= OUTSIDE_BIT
        prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.long, device=dev)
        words[prompt] |= PROMPT_BIT
        outputs = [t for t in seq.output_token_ids if t >= 0]  # a token still on the device is counted there
        if outputs:
            words.index_put_((torch.tensor(outputs, dtype=torch.long, device=dev),),
                             torch.ones(len(outputs), dtype=torch.int32, device=dev), accumulate=True)
        width = self.bias_ids.shape[1]
        self.bias_ids[slot] = torch.tensor(list(bias) + [0] * (width - len(bias)), device=dev)
        self.bias_values[slot] = torch.tensor(list(bias.values()) + [0.0] * (width - len(bias)), device=dev)
        width = self.banned.shape[1]
        self.banned[slot] = torch.tensor((banned + banned[:1] * width)[:width] if banned else [0] * width, device=dev)
        return slot

    def leave(self, slot: int) -> None:
        self.free.append(slot)


class SamplingState:
    """Row records of the known sequences (host), their penalty slots (device), seeds for unseeded ones."""

    def __init__(self, device: torch.device, seed: int, max_num_seqs: int = 4):
        """max_num_seqs: the penalty slots allocated at their first use (the sequence cap)."""
        self.device, self.max_num_seqs = device, max_num_seqs
        self.rng = random.Random(seed)  # unseeded sequences draw their seed here once: runs stay reproducible
        self.table = np.zeros((64, ROW), dtype=np.int32)
        self.free = list(range(63, -1, -1))
        self.index: dict[int, int] = {}  # seq_id -> row of the table
        self.uses_penalties: dict[int, bool] = {}  # seq_id -> penalised every step (not only under min_tokens)
        self.slots: PenaltySlots | None = None
        # seq_id -> its bad words of several tokens: the sampler checks them against the output, on the host
        self.bad_words: dict[int, list[list[int]]] = {}
        # the last step's sequences and their table rows: a step over the same ones reuses the rows' index
        self._seqs: list[Sequence] = []
        self._at = np.zeros(0, dtype=np.int64)

    def rows(self, seqs: list[Sequence], vocab_size: int, eos_token_ids: list[int]) -> np.ndarray:
        """The step's records, int32 [R, ROW], output positions set; sequences seen first here join."""
        if seqs == self._seqs:  # the last step's sequences in their order (a list compare by identity, in C)
            at = self._at
        else:
            index = self.index
            for seq in seqs:
                if seq.seq_id not in index:
                    self._join(seq, vocab_size, eos_token_ids)
            at = np.fromiter((index[s.seq_id] for s in seqs), dtype=np.int64, count=len(seqs))
            self._seqs, self._at = list(seqs), at
        rows = self.table[at]
        rows[:, ref.POSITION] = np.fromiter((len(s.token_ids) - s.num_prompt_tokens for s in seqs), dtype=np.int32,
                                            count=len(seqs))  # num_output_tokens, without the property's call
        return rows

    def processed(self, seqs: list[Sequence], rows: np.ndarray) -> np.ndarray:
        """Indices of the rows whose logits change before sampling this step (penalties, logit_bias, min_tokens
        not yet reached)."""
        slot = rows[:, SLOT]
        if not (slot >= 0).any():
            return np.zeros(0, dtype=np.int64)
        pen = np.fromiter((self.uses_penalties.get(s.seq_id, False) for s in seqs), dtype=bool, count=len(seqs))
        return np.flatnonzero((slot >= 0) & (pen | (rows[:, ref.POSITION] < rows[:, MIN_TOKENS])))

    def _join(self, seq: Sequence, vocab_size: int, eos_token_ids: list[int]) -> None:
        if not self.free:
            grown = np.zeros((2 * len(self.table), ROW), dtype=np.int32)
            grown[: len(self.table)] = self.table
            self.free = list(range(len(grown) - 1, len(self.table) - 1, -1))
            self.table = grown
        i = self.free.pop()
        self.index[seq.seq_id] = i
        p = seq.params
        rec = self.table[i]
        rec[:] = 0
        f = rec.view(np.float32)
        f[ref.INV_TEMPERATURE] = 0.0 if p.greedy else 1.0 / p.temperature
        rec[ref.TOP_K] = p.top_k if 0 < p.top_k < vocab_size else 0
        f[ref.TOP_P] = p.top_p
        f[ref.LOG_MIN_P] = math.log(p.min_p) if p.min_p > 0 else -math.inf
        seed = (seq.seed if seq.seed is not None else self.rng.getrandbits(64)) & (2**64 - 1)
        rec[ref.SEED_LO: ref.SEED_HI + 1] = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32).view(np.int32)
        f[REPETITION], f[PRESENCE], f[FREQUENCY] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        rec[SLOT] = -1
        if sequences := bad_word_sequences(seq):
            self.bad_words[seq.seq_id] = sequences
        if needs_slot(seq):
            banned = [t for t in dict.fromkeys([*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)])
                      if t < vocab_size] if p.min_tokens else []
            rec[MIN_TOKENS] = p.min_tokens if banned else 0
            if banned or _uses_penalties(seq):
                if self.slots is None:
                    self.slots = PenaltySlots(self.device, vocab_size, self.max_num_seqs)
                rec[SLOT] = self.slots.join(seq, banned)
                self.uses_penalties[seq.seq_id] = _uses_penalties(seq)

    def forget(self, seq: Sequence) -> None:
        i = self.index.pop(seq.seq_id, None)
        if i is None:
            return
        self._seqs = []  # its row may go to another sequence
        self.uses_penalties.pop(seq.seq_id, None)
        self.bad_words.pop(seq.seq_id, None)
        slot = int(self.table[i, SLOT])
        if slot >= 0:
            self.slots.leave(slot)
        self.free.append(i)
