"""The scheduler and block pool driven without a model (worker/core/scheduler.py, block_manager.py).

A hypothesis state machine adds requests (n samples, LoRA ids, prompts from a tiny vocabulary so prefixes
repeat), steps, aborts and resets the prefix cache at random. Each step is driven as LLMEngine.step drives
it: schedule, the batch's block copies, then every scheduled sequence's tokens written into the cache at its
block table, num_computed_tokens advanced, commit_full_blocks, samples forked once a prompt is done, one
token appended per sampling sequence, finish (or retire now and finish a step later, as an overlapped
step does). The KV cache is simulated as one token id per slot, so a block handed to two sequences, a prefix
hit on the wrong tokens (or another adapter's) or a missed copy-on-write shows as a slot holding the wrong token.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagefleet.worker.core.block_manager import BlockManager
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence, SequenceStatus

MAX_PROMPT = 12
MAX_TOKENS = 6
VOCAB = 3  # few distinct tokens: prompts share prefixes and whole blocks often
SYSTEM_PROMPTS = ([], [0, 1, 2, 0, 1, 2, 0, 1])  # half the requests start alike, as behind one chat template


class EngineWithoutModel(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        spare_blocks=st.integers(0, 8),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 24),
        enable_prefix_caching=st.booleans(),
        mixed_prefill_tokens=st.one_of(st.none(), st.integers(1, 8)),
    )
    def start(self, block_size, spare_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
              mixed_prefill_tokens):
        # The engine sizes the pool so one sequence of max_model_len fits; one block more leaves room for a copy.
        num_blocks = -(-(MAX_PROMPT + MAX_TOKENS) // block_size) + 1 + spare_blocks
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, mixed_prefill_tokens=mixed_prefill_tokens)
        self.cache = [[None] * block_size for _ in range(num_blocks)]  # (LoRA id, token id) each slot holds
        self.requests: dict[str, list[Sequence]] = {}
        self.n_of: dict[str, int] = {}
        self.retired: list[Sequence] = []  # last token on its way: out of the batch, finished next step
        self.next_id = 0

    # ---- what the engine does

    @rule(
        prompt=st.tuples(st.sampled_from(SYSTEM_PROMPTS), st.lists(st.integers(0, VOCAB - 1), max_size=MAX_PROMPT))
        .map(lambda parts: (parts[0] + parts[1])[:MAX_PROMPT] or [0]),
        n=st.integers(1, 6),
        max_tokens=st.integers(1, MAX_TOKENS),
        lora_id=st.sampled_from([0, 0, 1]),
    )
    def add(self, prompt, n, max_tokens, lora_id):
        n = min(n, self.sched.max_num_seqs)  # the server refuses n beyond max_num_seqs
        rid = f"r{self.next_id}"
        self.next_id += 1
        seq = Sequence(rid, 0, list(prompt), len(prompt), SamplingParams(n=n, max_tokens=max_tokens), None)
        seq.lora_id = lora_id
        seq.pending_forks = n - 1
        self.requests[rid] = [seq]
        self.n_of[rid] = n
        self.sched.add(seq)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        rid = sorted(self.requests)[pick % len(self.requests)]
        for seq in self.requests.pop(rid):
            if not seq.is_finished:
                self.sched.finish(seq)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        self.run_step(random.Random(seed))

    def run_step(self, rng: random.Random) -> None:
        sched, bm = self.sched, self.bm
        running_before, waiting_before = list(sched.running), list(sched.waiting)
        decoding = any(s.num_uncomputed_tokens == 1 for s in running_before)
        tokens_before = {seq.seq_id: list(seq.token_ids) for seq in running_before + waiting_before}
        batch = sched.schedule()
        for seq in self.retired:  # the overlapped step's token is read: the sequence finishes
            if not seq.is_finished:
                sched.finish(seq)
                self.forget_if_done(seq)
        self.retired = []

        # Token budget; the sequence cap at admission: the sequences running, the samples their parents still
        # fork and all samples of the request admitted fit under max_num_seqs, unless nothing runs.
        assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
        if decoding and sched.mixed_prefill_tokens is not None:  # prompt chunks beside decodes: held to the cap
            assert sum(n for n in batch.num_new_tokens if n > 1) <= sched.mixed_prefill_tokens
            decodes = [seq for seq in running_before if seq.num_uncomputed_tokens == 1]
            if len(decodes) + sched.mixed_prefill_tokens <= sched.max_num_batched_tokens and not batch.preempted:
                assert all(seq in batch.seqs for seq in decodes), "a decode waited for prompt chunks"
        seats = len(running_before) + sum(s.pending_forks for s in running_before)
        for seq in waiting_before:
            if seq in batch.seqs:
                assert seats == 0 or seats + 1 + seq.pending_forks <= sched.max_num_seqs
                seats += 1 + seq.pending_forks
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert 1 <= n <= seq.num_uncomputed_tokens
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        ones = [n == 1 for n in batch.num_new_tokens]
        assert ones == sorted(ones, reverse=True), "decodes lead the batch, prompt chunks follow"

        # Preemption: the most recently admitted go first, to the front of the queue, keeping their tokens.
        k = len(batch.preempted)
        if k:
            assert batch.preempted == running_before[::-1][:k]
            assert list(sched.waiting) == running_before[-k:] + waiting_before  # no admission in this step
            for seq in batch.preempted:
                assert seq.status is SequenceStatus.WAITING and seq not in batch.seqs
                assert seq.block_table == [] and seq.num_computed_tokens == 0
                assert seq.token_ids == tokens_before[seq.seq_id]
        else:
            admitted = [s for s in batch.seqs if s not in running_before]
            assert waiting_before[: len(admitted)] == sorted(admitted, key=waiting_before.index)  # oldest first
            assert list(sched.waiting) == waiting_before[len(admitted) :]

        # The forward: block copies first, then each scheduled token into its slot.
        for src, dst in batch.copies:
            self.cache[dst] = list(self.cache[src])
        sampling: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.cache[seq.block_table[pos // bm.block_size]][pos % bm.block_size] = (seq.lora_id,
                           seq.token_ids[pos])
            seq.num_computed_tokens += n
            bm.commit_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk that is not the last
            sampling.append(seq)
            for _ in range(seq.pending_forks):  # n > 1: the other samples split off here, sharing every block
                child = seq.fork(len(self.requests[seq.request_id]), None)
                bm.fork(seq, child)
                sched.add_forked(seq, child)
                self.requests[seq.request_id].append(child)
                sampling.append(child)
            seq.pending_forks = 0
        for seq in sampling:
            seq.token_ids.append(rng.randrange(VOCAB))
            if seq.num_output_tokens >= seq.params.max_tokens:
                if rng.random() < 0.5:
                    sched.finish(seq)
                    self.forget_if_done(seq)
                else:
                    sched.retire(seq)
                    self.retired.append(seq)

    def forget_if_done(self, seq: Sequence) -> None:
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and len(seqs) == self.n_of[seq.request_id] and all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]

    # ---- what must hold between steps

    def live(self) -> list[Sequence]:
        return [s for seqs in self.requests.values() for s in seqs if not s.is_finished]

    @invariant()
    def every_block_is_counted_once_per_table_holding_it(self):
        held: dict[int, int] = {}
        for seq in self.live():
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                held[block_id] = held.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == held.get(block.block_id, 0), f"block {block.block_id} leaked or over-freed"
        assert set(self.bm.free) == {b.block_id for b in self.bm.blocks if b.ref_count == 0}
        assert self.bm.pending_copies == []

    @invariant()
    def waiting_and_retired_sequences_hold_no_blocks(self):
        retired = [s for s in self.retired if not s.is_finished]  # an abort may have finished one already
        for seq in [*self.sched.waiting, *retired]:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        queued = [*self.sched.running, *self.sched.waiting, *retired]
        assert sorted(s.seq_id for s in self.live()) == sorted(s.seq_id for s in queued)

    @invariant()
    def the_cache_holds_each_sequences_computed_tokens(self):
        bs = self.bm.block_size
        for seq in self.sched.running:
            for pos in range(seq.num_computed_tokens):
                assert self.cache[seq.block_table[pos // bs]][pos % bs] == (seq.lora_id, seq.token_ids[pos]), pos

    @invariant()
    def prefix_hashes_point_only_at_blocks_holding_their_tokens(self):
        assert self.bm.hash_to_block == {b.hash: b.block_id for b in self.bm.blocks if b.hash is not None}
        for block_id in self.bm.hash_to_block.values():
            assert tuple(t for _, t in self.cache[block_id]) == self.bm.blocks[block_id].token_ids
        hashed = [b.hash is not None for b in (self.bm.blocks[i] for i in self.bm.free)]
        assert hashed == sorted(hashed), "free blocks worth nothing are handed out before cached ones"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        rng = random.Random(0)
        for _ in range(5000):
            if not self.requests and not self.retired:
                break
            self.run_step(rng)
            self.every_block_is_counted_once_per_table_holding_it()
            self.the_cache_holds_each_sequences_computed_tokens()
        assert not self.requests, "the queue did not drain"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert not self.sched.running and not self.sched.waiting
        self.prefix_hashes_point_only_at_blocks_holding_their_tokens()


EngineWithoutModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, derandomize=True
)
test_engine_without_model = EngineWithoutModel.TestCase


def test_samples_still_to_fork_count_against_max_num_seqs():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=2, max_num_batched_tokens=64)
    parent = Sequence("a", 0, [1, 2, 3], 3, SamplingParams(n=2), None)
    parent.pending_forks = 1
    sched.add(parent)
    sched.add(Sequence("b", 0, [4, 5, 6], 3, SamplingParams(), None))
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    child = parent.fork(1, None)
    sched.block_manager.fork(parent, child)
    sched.add_forked(parent, child)
    parent.pending_forks = 0
    assert len(sched.running) <= sched.max_num_seqs


def jumping_step(max_chunks: int | None, max_num_seqs: int = 8) -> dict[str, int]:
    """Four sequences past their prompts, each with a drawn token and five forced ones to run, and a prompt
    waiting: each one's tokens in the next step."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                      max_chunks=max_chunks)
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3, 4], 4, SamplingParams(), None) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    for seq, n in zip((batch := sched.schedule()).seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    for seq in seqs:
        seq.token_ids += [7, 8, 8, 8, 8, 8]
        seq.jumping = True
    sched.add(Sequence("prompt", 0, [5, 6, 7], 3, SamplingParams(), None))
    batch = sched.schedule()
    return dict(zip((s.request_id for s in batch.seqs), batch.num_new_tokens))


def test_jumping_chunks_past_max_chunks_run_a_token_a_step():
    """Jump-forward's chunks share a step's max_chunks with the prompts running and waiting; the jumping
    sequences past them run one forced token (a later step takes the rest as a chunk)."""
    # one chunk kept for the waiting prompt, two for the first two jumping sequences, one token for the others
    assert jumping_step(3) == {"r0": 6, "r1": 6, "r2": 1, "r3": 1, "prompt": 3}
    assert jumping_step(None) == {"r0": 6, "r1": 6, "r2": 6, "r3": 6, "prompt": 3}  # no graphs: no limit
    # the sequence cap keeps the prompt waiting: it takes no chunk, so the jumping sequences get all three
    assert jumping_step(3, max_num_seqs=4) == {"r0": 6, "r1": 6, "r2": 6, "r3": 1}


def test_prompt_chunks_beside_decodes_are_held_to_mixed_prefill_tokens():
    """Decodes run in full; the prompts beside them share mixed_prefill_tokens, oldest first; a step with no
    decode gives a prompt the whole budget."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=32, mixed_prefill_tokens=5)

    def step() -> dict[str, int]:
        batch = sched.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(9)  # the sampled token: next step it decodes
        return {seq.request_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}

    for rid in ("a", "b"):
        sched.add(Sequence(rid, 0, [1, 2, 3], 3, SamplingParams(), None))
    assert step() == {"a": 3, "b": 3}  # no decode yet: prompts take what the budget gives
    for rid, length in (("c", 7), ("d", 40)):
        sched.add(Sequence(rid, 0, list(range(10, 10 + length)), length, SamplingParams(), None))
    assert step() == {"a": 1, "b": 1, "c": 5}
    assert step() == {"a": 1, "b": 1, "c": 2, "d": 3}
    assert step() == {"a": 1, "b": 1, "c": 1, "d": 5}
    sched.finish(sched.running[0]), sched.finish(sched.running[0]), sched.finish(sched.running[0])
    assert step() == {"d": 32}  # d alone: no decode beside it, the whole budget
