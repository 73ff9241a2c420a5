"""State slots without a model (worker/core/state_slots.py through the block manager and scheduler).

A slot is taken at admission and given back at finish, abort and preemption in the same step; forked samples
get their own slot as a copy of the parent's; a prefix hit ends where a state snapshot exists and restores it.
The random run at the end drives the scheduler as LLMEngine.step does and simulates the state cache as the
token ids each slot has absorbed, so a wrong zero, copy, restore or snapshot shows as a slot holding the
wrong history.
"""

from __future__ import annotations

import random

import pytest

from pagefleet.worker.core.block_manager import BlockManager
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.scheduler import Scheduler
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.core.state_slots import StateSlots

BS = 4


def make_seq(tokens, n=1, rid="r", max_tokens=4) -> Sequence:
    seq = Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(n=n, max_tokens=max_tokens), None)
    seq.pending_forks = n - 1
    return seq


def scheduler(num_blocks=64, slots=4, snapshots=0, budget=64, max_num_seqs=8, prefix=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, prefix, StateSlots(slots, snapshots))
    return Scheduler(bm, max_num_seqs, budget)


def run(sched: Scheduler, batch) -> None:
    """What the engine does after the forward: tokens computed, full blocks hashed."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        sched.block_manager.commit_full_blocks(seq)


def test_slot_taken_at_admission_and_zeroed_once():
    sched = scheduler()
    a, b = make_seq(range(10, 16), rid="a"), make_seq(range(20, 23), rid="b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert sorted(batch.state_zeros) == [0, 1] and batch.state_copies == [] and batch.state_snapshots == []
    run(sched, batch)
    a.token_ids.append(5)
    b.token_ids.append(6)
    batch = sched.schedule()  # decodes: the slots keep their state
    assert batch.state_zeros == [] and batch.state_copies == []
    assert sched.block_manager.state.num_free == 2


@pytest.mark.parametrize("how", ["finish", "abort_waiting", "retire"])
def test_finish_abort_and_retire_free_the_slot_in_the_same_step(how):
    sched = scheduler(slots=1)
    a, b = make_seq(range(10, 16), rid="a"), make_seq(range(20, 26), rid="b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a] and sched.waiting[0] is b  # one slot: b waits for it
    run(sched, batch)
    a.token_ids.append(5)
    if how == "abort_waiting":
        sched.finish(b)  # b never held a slot
        assert b.state_slot is None and sched.block_manager.state.num_free == 0
        return
    getattr(sched, "finish" if how == "finish" else "retire")(a)
    assert a.state_slot is None and sched.block_manager.state.num_free == 1
    batch = sched.schedule()  # the very next step admits b into the slot a gave back, zeroed
    assert batch.seqs == [b] and b.state_slot == 0 and batch.state_zeros == [0]


def test_preemption_frees_the_slot_and_readmission_starts_from_zero():
    sched = scheduler(num_blocks=4, slots=2, budget=64, prefix=False)
    a, b = make_seq(range(10, 17), rid="a"), make_seq(range(20, 27), rid="b")  # 2 blocks each
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    a.token_ids += [5, 6]  # a's 9th token needs a third block: b is preempted for it
    b.token_ids.append(7)
    a.num_computed_tokens += 1  # a's 8th token computed in a step not shown
    batch = sched.schedule()
    assert batch.preempted == [b] and b.state_slot is None and b.num_computed_tokens == 0
    assert sched.block_manager.state.num_free == 1 and batch.state_zeros == []
    sched.finish(a)
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.state_zeros == [b.state_slot] and batch.num_new_tokens == [8]


def test_forked_samples_copy_the_parent_state_once():
    sched = scheduler(slots=4)
    parent = make_seq(range(10, 16), n=3)
    sched.add(parent)
    batch = sched.schedule()
    run(sched, batch)
    children = []
    for i in (1, 2):
        child = parent.fork(i, None)
        sched.block_manager.fork(parent, child)
        sched.add_forked(parent, child)
        children.append(child)
    parent.pending_forks = 0
    for seq in [parent, *children]:
        seq.token_ids.append(9)
    batch = sched.schedule()
    assert sorted(batch.state_copies) == sorted((parent.state_slot, c.state_slot) for c in children)
    assert len({parent.state_slot, *(c.state_slot for c in children)}) == 3 and batch.state_zeros == []
    assert sched.schedule().state_copies == []  # once


def test_requests_wait_for_their_samples_slots():
    sched = scheduler(slots=4)
    group, single = make_seq(range(10, 16), n=3, rid="g"), make_seq(range(20, 26), rid="s")
    late = make_seq(range(30, 36), rid="late")
    sched.add(group)
    sched.add(single)
    sched.add(late)
    batch = sched.schedule()
    # the group's parent and its two samples to come, plus the single: four slots; the late one waits
    assert batch.seqs == [group, single] and list(sched.waiting) == [late]
    assert sched.block_manager.state.num_free == 2  # held for the samples the parent forks


def test_a_freed_slot_drops_its_pending_zero_and_copies_into_it():
    slots = StateSlots(3)
    a = slots.take()
    b = slots.fork(a)
    slots.release(b, seq_id=1)
    slots.release(a, seq_id=0)
    assert slots.take_ops() == ([], [], [])
    with pytest.raises(AssertionError, match="freed twice"):
        slots.release(a, seq_id=0)


def test_pool_exhaustion():
    slots = StateSlots(1)
    slots.take()
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.take()
    with pytest.raises(ValueError):
        StateSlots(0)


# ---- prefix caching with state snapshots


def prefill(sched: Scheduler, seq: Sequence) -> list:
    """Schedule and run steps until seq's prompt is done; the batches."""
    batches = []
    while seq.num_computed_tokens < seq.num_tokens:
        batch = sched.schedule()
        run(sched, batch)
        batches.append(batch)
    return batches


def test_the_prompt_chunk_ends_at_the_snapshot_boundary_and_a_repeat_restores_it():
    sched = scheduler(slots=2, snapshots=2)
    prompt = list(range(10, 21))  # 11 tokens: a repeat hits 2 full blocks (8 tokens)
    first = make_seq(prompt, rid="first")
    sched.add(first)
    batches = prefill(sched, first)
    assert [b.num_new_tokens for b in batches] == [[8], [3]]  # cut at the boundary, though the budget is 64
    assert batches[0].state_snapshots == [(first.state_slot, 2)]  # snapshot slots follow the sequence slots
    state = sched.block_manager.state
    assert list(state.snapshot_of.values()) == [2]
    sched.finish(first)
    again = make_seq(prompt, rid="again")
    sched.add(again)
    batches = prefill(sched, again)
    assert again.num_cached_tokens == 8 and [b.num_new_tokens for b in batches] == [[3]]
    assert batches[0].state_copies == [(2, again.state_slot)] and batches[0].state_zeros == []
    assert batches[0].state_snapshots == []  # the boundary was restored, not recomputed


def test_a_hit_without_a_snapshot_at_its_end_is_cut_back():
    sched = scheduler(slots=2, snapshots=2)
    first = make_seq(range(10, 19), rid="first")  # 9 tokens: snapshot at 8
    sched.add(first)
    prefill(sched, first)
    sched.finish(first)
    longer = make_seq(list(range(10, 22)) + [1, 2, 3], rid="longer")  # shares 3 cached blocks? only 2 are cached
    sched.add(longer)
    prefill(sched, longer)
    assert longer.num_cached_tokens == 8  # the snapshot at 8, not the 3rd block (no state there)
    sched.finish(longer)
    other = make_seq(list(range(10, 14)) + [7, 7, 7, 7, 7], rid="other")  # shares only the first block
    sched.add(other)
    batch = sched.schedule()
    assert other.num_cached_tokens == 0 and batch.state_zeros == [other.state_slot]


def test_snapshot_dropped_with_its_block_and_least_recently_used_evicted():
    sched = scheduler(num_blocks=64, slots=1, snapshots=1)
    state, bm = sched.block_manager.state, sched.block_manager
    a = make_seq(range(10, 19), rid="a")
    sched.add(a)
    prefill(sched, a)
    sched.finish(a)
    (h_a,) = state.snapshot_of
    b = make_seq(range(40, 49), rid="b")
    sched.add(b)
    prefill(sched, b)
    sched.finish(b)
    assert h_a not in state.snapshot_of and len(state.snapshot_of) == 1  # one snapshot slot: a's evicted
    bm.reset_prefix_cache()
    assert not state.snapshot_of and state.free_snapshots == [1]


def test_prefix_caching_off_takes_no_snapshots():
    sched = scheduler(slots=2, snapshots=2, prefix=False)
    seq = make_seq(range(10, 21))
    sched.add(seq)
    batches = prefill(sched, seq)
    assert [b.num_new_tokens for b in batches] == [[11]] and not batches[0].state_snapshots


# ---- a random engine run with the state cache simulated


def simulate(seed: int) -> None:
    rng = random.Random(seed)
    slots = rng.randint(1, 5)
    snapshots = rng.choice([0, 1, 3])
    max_prompt, max_tokens = 14, 5
    num_blocks = -(-(max_prompt + max_tokens) // BS) + 1 + rng.randint(0, 8)
    bm = BlockManager(num_blocks, BS, rng.random() < 0.8, StateSlots(slots, snapshots))
    sched = Scheduler(bm, rng.randint(1, 6), rng.randint(1, 20))
    state = [()] * (slots + snapshots + 1)  # each slot's history; the last one: never handed out
    live: dict[str, list[Sequence]] = {}
    n_of: dict[str, int] = {}
    retired: list[Sequence] = []
    shared = [0, 1, 2, 0, 1, 2, 0, 1]
    for step in range(400):
        if step < 80 and rng.random() < 0.4:
            n = rng.randint(1, min(slots, sched.max_num_seqs))
            prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(3) for _ in range(rng.randint(0, 8))]
            seq = make_seq(prompt[:max_prompt] or [0], n=n, rid=f"r{step}", max_tokens=rng.randint(1, max_tokens))
            live[seq.request_id], n_of[seq.request_id] = [seq], n
            sched.add(seq)
        if step < 80 and live and rng.random() < 0.1:
            for seq in live.pop(rng.choice(sorted(live))):
                if not seq.is_finished:
                    sched.finish(seq)
        if rng.random() < 0.05:
            bm.reset_prefix_cache()
        batch = sched.schedule()
        for seq in retired:
            if not seq.is_finished:
                sched.finish(seq)
        retired = []
        # the executor: copies (gathered first), then zeros, the forward, then snapshots
        for (_, dst), history in zip(batch.state_copies, [state[s] for s, _ in batch.state_copies]):
            state[dst] = history
        for z in batch.state_zeros:
            state[z] = ()
        sampling = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.state_slot is not None
            assert state[seq.state_slot] == tuple(seq.token_ids[: seq.num_computed_tokens]), "state before forward"
            state[seq.state_slot] += tuple(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
        for src, dst in batch.state_snapshots:
            state[dst] = state[src]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            bm.commit_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            sampling.append(seq)
            for _ in range(seq.pending_forks):
                child = seq.fork(len(live[seq.request_id]), None)
                bm.fork(seq, child)
                sched.add_forked(seq, child)
                live[seq.request_id].append(child)
                sampling.append(child)
            seq.pending_forks = 0
        for seq in sampling:
            seq.token_ids.append(rng.randrange(3))
            if seq.num_output_tokens >= seq.params.max_tokens:
                if rng.random() < 0.5:
                    sched.finish(seq)
                else:
                    sched.retire(seq)
                    retired.append(seq)
        for rid in [r for r, seqs in live.items() if len(seqs) == n_of[r] and all(s.is_finished for s in seqs)]:
            del live[rid]
        # between steps: slots held once each by running sequences; free + held + snapshots = all
        holders = [s.state_slot for seqs in live.values() for s in seqs if s.state_slot is not None]
        assert len(holders) == len(set(holders))
        assert {s.state_slot for s in sched.running} == set(holders)
        assert all(s.state_slot is None for s in sched.waiting)
        st = bm.state
        snap_slots = list(st.snapshot_of.values()) + [p[1] for p in st.pending_snapshots.values()]
        assert sorted(holders + st.free) == list(range(slots))
        assert sorted(snap_slots + st.free_snapshots) == list(range(slots, slots + snapshots))
        for h, snap in st.snapshot_of.items():  # each snapshot: the history of the prefix ending at its block
            block = bm.blocks[bm.hash_to_block[h]]
            assert len(state[snap]) % BS == 0 and state[snap][-BS:] == block.token_ids
        if step >= 80 and not live and not retired:
            break
    assert not live, "the queue did not drain"
    assert bm.state.num_free == slots and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("seed", range(40))
def test_random_run_keeps_every_slot_history_right(seed):
    simulate(seed)
