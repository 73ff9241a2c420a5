"""The per-step decision: which sequences run this step, with how many tokens each, and who is preempted.

One token budget per step (`max_num_batched_tokens`), no separate prefill and decode phases: running
sequences go first (a decode costs one token, an unfinished prompt takes what is left as its next
chunk), then waiting requests first-come-first-served. With `mixed_prefill_tokens` set, a step that carries
decodes holds its prompt chunks (and preempted sequences' recomputes) to that many tokens, as Sarathi-Serve's
stall-free batching does: a decode step of a few rows reads every weight and leaves the GEMMs' arithmetic idle,
so prompt tokens up to about the ridge point ride along at little cost, where a wave of prompts let into
8,192-token steps stalls every decode behind it and keeps a closed loop's requests arriving in waves. When the
pool runs dry the most recently admitted sequence is preempted by recompute: its blocks are freed, it keeps
every token it produced, and it goes back to the front of the queue.

Structured outputs' jump-forward gives running sequences chunks of forced tokens. A step of more chunks than
the mixed CUDA graphs hold runs eagerly, at several times the cost, so at most `max_chunks` chunks run a step:
the prompts in flight and those waiting that the sequence cap lets in count first, and a jumping sequence past
the rest runs one forced token, as it would have without the jump.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagefleet.worker.core.block_manager import BlockManager, BlockTables
from pagefleet.worker.core.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


@dataclass
class ScheduledBatch:
    """One step's work, handed to the executor: each sequence with the tokens it computes now (decodes
    first), the block copies to run before the forward, and the sequences preempted to make room."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to run first
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # taken off the queue: their grammar failed to compile
    # models with recurrent state (core/state_slots.py): state slot copies (src, dst) and the fresh slots to zero,
    # both before the forward, copies first; sequence slots copied into snapshot slots after the forward
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_zeros: list[int] = field(default_factory=list)
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)
    block_tables: BlockTables | None = None  # the block manager's rows kept across steps (None: built afresh)
    scoring: list[tuple[int, int, int]] | None = None  # prompt_logprob_spans, once asked (None: not yet)

    def prompt_logprob_spans(self) -> list[tuple[int, int, int]]:
        """The prompt positions this step scores (SamplingParams.prompt_logprobs): (sequence's index in the batch,
        first position, end position), where position j's logits score prompt token j + 1. A chunk scores the
        positions it runs that are not scored yet (a preempted prompt runs again from its start), up to the
        prompt's last token, whose logits sample. Scanned once a step; whoever changes `seqs` resets `scoring`."""
        if self.scoring is not None:
            return self.scoring
        self.scoring = spans = []
        for i, seq in enumerate(self.seqs):  # every step, every row: one attribute read for a row that asks none
            scored = seq.prompt_logprobs
            if scored is None or not seq.needs_prompt_logprobs:
                continue
            computed = seq.num_computed_tokens
            assert len(scored) >= computed, "prompt positions skipped unscored"
            start, end = len(scored), min(computed + self.num_new_tokens[i], seq.num_prompt_tokens - 1)
            if start < end:
                spans.append((i, start, end))
        return spans


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_chunks: int | None = None, mixed_prefill_tokens: int | None = None):
        """max_chunks: the most multi-token entries a step's graphs hold (None: no limit); only jumping
        sequences' chunks are held to it. mixed_prefill_tokens: the most prompt tokens in a step that also
        decodes (None: the whole budget)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.max_chunks = max_chunks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(block_tables=self.block_manager.tables)
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        stateful = bm.state is not None  # without recurrent state, chunks never end at a snapshot boundary
        seqs, counts = batch.seqs, batch.num_new_tokens
        bs, blocks = bm.block_size, bm.blocks
        jump_chunks = None  # chunks left for jumping sequences this step, counted at the first one
        # prompt tokens this step may still take: all of the budget unless a running sequence decodes
        prompt_budget = budget
        if self.mixed_prefill_tokens is not None and any(
                s.num_uncomputed_tokens == 1 for s in self.running):
            prompt_budget = min(budget, self.mixed_prefill_tokens)
        # 1. Running sequences: decodes and unfinished prompt chunks (every running sequence: kept to reads).
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not RUNNING:  # preempted earlier in this loop
                continue
            computed, table = seq.num_computed_tokens, seq.block_table
            n = min(len(seq.token_ids) - computed, budget)
            prompt = n > 1 and not seq.jumping  # a prompt chunk, or a preempted sequence's recompute
            if prompt:
                if prompt_budget == 0:
                    continue
                n = min(n, prompt_budget)
            if n > 1 and seq.jumping and self.max_chunks is not None:
                if jump_chunks is None:
                    jump_chunks = self._jump_chunks()
                if jump_chunks > 0:
                    jump_chunks -= 1
                else:
                    n = 1
            if stateful:
                n = bm.state_chunk(seq, n)
            elif n == 1 and computed < len(table) * bs and blocks[table[computed // bs]].ref_count == 1:
                # allocate's no-op, inlined: a decode inside its own last block, which no other sequence holds
                seqs.append(seq)
                counts.append(1)
                budget -= 1
                continue
            while not bm.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is RUNNING:
                if stateful:
                    bm.plan_snapshot(seq, n)
                seqs.append(seq)
                counts.append(n)
                budget -= n
                if prompt:
                    prompt_budget -= n
        # 2. Waiting requests, oldest first, unless this step already had to preempt. The samples a running
        # parent still forks count against the sequence cap: they join the batch once its prompt is done, and
        # the decode graphs and the memory profile are sized for max_num_seqs rows. With recurrent state each
        # sample needs its own state slot: a request waits until its samples' slots and those owed to the
        # samples running parents still fork are free.
        num_seqs = owed = None
        compiling: list[Sequence] = []  # grammars still compiling: they wait aside, keeping their place
        while self.waiting and min(budget, prompt_budget) > 0 and not batch.preempted:
            seq = self.waiting[0]
            if seq.grammar is not None and not seq.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            if seq.grammar is not None and seq.grammar.error is not None:
                batch.failed.append(self.waiting.popleft())  # the engine ends it with the reason
                continue
            if num_seqs is None:
                owed = sum(s.pending_forks for s in self.running)
                num_seqs = len(self.running) + owed
            if num_seqs + seq.pending_forks + 1 > self.max_num_seqs and self.running:
                break
            if not self.block_manager.can_take_state_slots(owed + seq.pending_forks + 1):
                break
            if not seq.block_table:
                self.block_manager.match_prefix(seq)
            n = self.block_manager.state_chunk(seq, min(seq.num_uncomputed_tokens, budget, prompt_budget))
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free_sequence(seq)  # give back the prefix hits; retry next step
                seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            self.block_manager.take_state_slot(seq)
            self.block_manager.plan_snapshot(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            prompt_budget -= n
            num_seqs += seq.pending_forks + 1
            owed += seq.pending_forks
        self.waiting.extendleft(reversed(compiling))
        batch.copies = self.block_manager.take_copies()
        batch.state_copies, batch.state_zeros, batch.state_snapshots = self.block_manager.take_state_ops()
        _decodes_first(batch)
        return batch

    def _jump_chunks(self) -> int:
        """This step's chunks for jumping sequences: max_chunks less the prompts running and those waiting that
        the sequence cap lets in (each may join the step as a chunk)."""
        prompts = sum(1 for s in self.running if s.num_computed_tokens < s.num_prompt_tokens)
        admissible = max(0, self.max_num_seqs - len(self.running))
        return self.max_chunks - prompts - min(len(self.waiting), admissible, self.max_chunks)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.jumping = False  # its forced tokens are recomputed with the rest, a prompt's chunks
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """A sample split off `parent` after its prompt: runs right behind it."""
        self.running.insert(self.running.index(parent) + 1, child)

    def retire(self, seq: Sequence) -> None:
        """A sequence whose last token is still being computed: out of the batch, blocks back to the pool;
        `finish` follows once the token is read."""
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks now, so the next step can hand them out."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED


def _decodes_first(batch: ScheduledBatch) -> None:
    """One-token entries lead the batch, so attention runs them through the decode kernel and only
    the prompt chunks after them through the prefill kernel (stable: order within each group kept)."""
    counts = batch.num_new_tokens
    if counts.count(1) == len(counts) or all(n > 1 for n in counts):  # count: pure decode steps, in C
        return
    order = [i for i, n in enumerate(counts) if n == 1] + [i for i, n in enumerate(counts) if n > 1]
    batch.seqs = [batch.seqs[i] for i in order]
    batch.num_new_tokens = [counts[i] for i in order]
