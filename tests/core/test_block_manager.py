"""The KV block pool without a model (worker/core/block_manager.py): prefix hits and copy-on-write.

Sequences are built from Sequence + SamplingParams alone; the engine's part (computing tokens, hashing the
blocks a step filled) is done by hand, as llm_engine.step does it: num_computed_tokens advances, then
commit_full_blocks.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.worker.core import block_manager as block_manager_mod
from pagefleet.worker.core.block_manager import BlockManager
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.core.sequence import Sequence

BS = 4
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def make_seq(tokens: list[int], lora_id: int = 0, n: int = 1) -> Sequence:
    seq = Sequence("r", 0, list(tokens), len(tokens), SamplingParams(n=n), None)
    seq.lora_id = lora_id
    return seq


def compute_prompt(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` (prefix lookup, then blocks for the rest of its prompt) and mark the prompt computed."""
    hit = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    return hit


def check_pool(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Reference counts equal the block tables holding each block; free queue = blocks nobody holds."""
    held: dict[int, int] = {}
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in one table: {seq.block_table}"
        for block_id in seq.block_table:
            held[block_id] = held.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0), f"block {block.block_id}"
    assert set(bm.free) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert bm.hash_to_block == {b.hash: b.block_id for b in bm.blocks if b.hash is not None}


prompts = st.lists(st.integers(0, 50), min_size=1, max_size=6 * BS)


@SETTINGS
@given(prompt=prompts)
def test_a_repeated_prompt_hits_its_full_blocks_never_its_last_token(prompt):
    bm = BlockManager(num_blocks=32, block_size=BS)
    first = make_seq(prompt)
    assert compute_prompt(bm, first) == 0
    first_table = list(first.block_table)
    bm.free_sequence(first)
    again = make_seq(prompt)
    hit = bm.match_prefix(again)
    assert hit == (len(prompt) - 1) // BS * BS  # a prompt of whole blocks still computes its last block
    assert hit < len(prompt)
    assert again.num_computed_tokens == again.num_cached_tokens == hit
    assert again.block_table == first_table[: hit // BS]
    assert bm.prefix_queries == 2 * len(prompt) and bm.prefix_hits == hit
    check_pool(bm, [again])


@SETTINGS
@given(prompt=st.lists(st.integers(0, 50), min_size=2 * BS + 1, max_size=6 * BS), data=st.data())
def test_one_different_token_hits_only_the_blocks_before_it(prompt, data):
    bm = BlockManager(num_blocks=32, block_size=BS)
    first = make_seq(prompt)
    compute_prompt(bm, first)
    bm.free_sequence(first)
    at = data.draw(st.integers(0, len(prompt) - 1), label="changed position")
    changed = list(prompt)
    changed[at] += 1
    seq = make_seq(changed)
    assert bm.match_prefix(seq) == min(at // BS, (len(prompt) - 1) // BS) * BS


@SETTINGS
@given(prompt=st.lists(st.integers(0, 50), min_size=BS + 1, max_size=6 * BS), lora=st.integers(1, 4))
def test_another_lora_adapter_does_not_hit_the_base_models_blocks(prompt, lora):
    bm = BlockManager(num_blocks=32, block_size=BS)
    base = make_seq(prompt)
    compute_prompt(bm, base)
    bm.free_sequence(base)
    assert bm.match_prefix(make_seq(prompt, lora_id=lora)) == 0
    adapted = make_seq(prompt, lora_id=lora)
    compute_prompt(bm, adapted)
    bm.free_sequence(adapted)
    assert bm.match_prefix(make_seq(prompt, lora_id=lora)) == (len(prompt) - 1) // BS * BS


def test_a_hash_hit_is_rechecked_token_by_token(monkeypatch):
    """Two prompts whose blocks collide in the hash: the second finds the first's block and refuses it."""
    monkeypatch.setattr(block_manager_mod, "block_hash", lambda parent, tokens, adapter_id=0: 7)
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq([1, 2, 3, 4, 5])
    compute_prompt(bm, first)
    bm.free_sequence(first)
    assert bm.hash_to_block  # the colliding hash points at the first prompt's block
    other = make_seq([9, 9, 9, 9, 5])
    assert bm.match_prefix(other) == 0
    assert other.block_table == []
    same = make_seq([1, 2, 3, 4, 6])
    assert bm.match_prefix(same) == BS


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = make_seq(list(range(9)))
    compute_prompt(bm, first)
    bm.free_sequence(first)
    assert bm.hash_to_block == {}
    assert bm.match_prefix(make_seq(list(range(9)))) == 0


def test_cached_blocks_are_evicted_last_and_forgotten_when_reused():
    """A freed block with no hash is handed out before any cached one; taking a cached block drops its hash."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    cached = make_seq(list(range(2 * BS + 1)))  # two full (hashed) blocks and one partial
    compute_prompt(bm, cached)
    bm.free_sequence(cached)
    full = [b.block_id for b in bm.blocks if b.hash is not None]
    assert len(full) == 2
    assert set(list(bm.free)[-2:]) == set(full)  # at the back of the queue
    new = make_seq([100 + t for t in range(2 * BS)])
    bm.match_prefix(new)
    assert bm.allocate(new, new.num_uncomputed_tokens)
    assert not set(new.block_table) & set(full)  # the two blocks worth nothing went first
    assert len(bm.hash_to_block) == 2
    third = make_seq([200 + t for t in range(BS)])
    bm.match_prefix(third)
    assert bm.allocate(third, BS)
    assert len(bm.hash_to_block) == 1  # one cached block was evicted to make room
    check_pool(bm, [new, third])


@SETTINGS
@given(prompt_len=st.integers(1, 5 * BS), samples=st.integers(2, 5))
def test_forked_samples_share_blocks_and_the_first_write_copies_a_shared_one(prompt_len, samples):
    bm = BlockManager(num_blocks=64, block_size=BS)
    parent = make_seq(list(range(prompt_len)), n=samples)
    compute_prompt(bm, parent)
    children = [parent.fork(i, None) for i in range(1, samples)]
    for child in children:
        bm.fork(parent, child)
    seqs = [parent, *children]
    for block_id in parent.block_table:
        assert bm.blocks[block_id].ref_count == samples
    check_pool(bm, seqs)
    partial = prompt_len % BS != 0  # the last prompt block has room for the first sampled token
    shared_last = parent.block_table[-1]
    for i, seq in enumerate(seqs):
        seq.token_ids.append(1000 + i)
        assert bm.allocate(seq, 1)
        copies = bm.take_copies()
        last_writer = i == samples - 1  # every other sample let go of the shared block: it writes in place
        if partial and not last_writer:
            (src, dst), = copies
            assert src == shared_last and dst == seq.block_table[-1] != shared_last
        else:
            assert copies == []
        seq.num_computed_tokens += 1
        check_pool(bm, seqs)
    full = prompt_len // BS
    for seq in seqs:  # the full prompt blocks stay shared by every sample
        assert seq.block_table[:full] == parent.block_table[:full]
    assert len({seq.block_table[-1] for seq in seqs}) == samples
    for seq in seqs:
        bm.free_sequence(seq)
    check_pool(bm, [])
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_changes_nothing_when_the_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(list(range(3 * BS)))
    assert not bm.allocate(seq, seq.num_tokens)
    assert seq.block_table == [] and bm.num_free_blocks == 2 and bm.pending_copies == []

