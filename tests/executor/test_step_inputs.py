"""The step inputs (worker/executor/step_inputs.py, built with numpy over the whole batch) against a per-sequence
rebuild, and their uploads' alignment."""

import numpy as np
import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.scheduler import ScheduledBatch, _decodes_first
from pagefleet.worker.executor.step_inputs import feed_device_tokens, shared_prefix_groups, upload_int32, upload_rows


def naive_prepare(batch, block_size):
    ids, pos, slots, lens, cu, rows = [], [], [], [], [0], []
    for seq, k in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        for p in range(start, start + k):
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        lens.append(start + k)
        cu.append(cu[-1] + k)
        if start + k == seq.num_tokens:
            rows.append(cu[-1] - 1)
    # the one-token entries ahead of the first prompt chunk, in a step that has one
    counts = batch.num_new_tokens
    num_decodes = 0 if all(k == 1 for k in counts) else next(i for i, k in enumerate(counts) if k != 1)
    return np.array([ids, pos, slots]), np.array(lens), np.array(cu), rows, num_decodes


@pytest.mark.parametrize("budget", [7, 40, 512])  # many chunks, a mix, whole prompts
def test_prepare_matches_a_per_sequence_rebuild(tiny_models, budget):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=200,
              max_num_batched_tokens=budget, block_size=8)
    runner = llm.engine.runner
    original = runner.prepare
    checked = []

    def checking_prepare(batch):
        step = original(batch)
        tokens, seq_lens, cu, tables, rows, num_decodes = step[:6]  # state_slots: None for Llama
        want_tokens, want_lens, want_cu, want_rows, want_decodes = naive_prepare(batch, 8)
        assert np.array_equal(tokens, want_tokens) and np.array_equal(seq_lens, want_lens)
        assert np.array_equal(cu, want_cu) and rows == want_rows and num_decodes == want_decodes
        assert step.is_decode == (sum(batch.num_new_tokens) == len(batch.seqs))
        assert tables.shape[1] % 4 == 0  # rows start 16-byte aligned
        for i, seq in enumerate(batch.seqs):
            width = len(seq.block_table)
            assert list(tables[i, :width]) == seq.block_table and not tables[i, width:].any()
        checked.append((step.is_decode, num_decodes > 0))
        return step

    runner.prepare = checking_prepare
    prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([3, 37, 9, 64, 1, 20])]
    llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True) for i in range(6)])
    # pure decode steps were checked, and steps with decodes ahead of prompt tokens (the 1-token prompt is one)
    assert {(True, False), (False, True)} <= set(checked), checked


def test_upload_int32_starts_every_array_16_byte_aligned():
    arrays = [np.arange(n, dtype=np.int32) + 10 * n for n in (1, 5, 3, 8, 2)]
    for got, want in zip(upload_int32(torch.device("cpu"), *arrays), arrays, strict=True):
        assert got.data_ptr() % 16 == 0 and got.tolist() == want.tolist()


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 333])
def test_upload_rows_starts_every_row_16_byte_aligned(num_tokens):
    """The positions row feeds RoPE; at an odd token count it started 8 bytes off, a new Triton compile."""
    tokens = np.arange(3 * num_tokens, dtype=np.int64).reshape(3, num_tokens)
    rows = upload_rows(tokens, torch.device("cpu"))
    assert rows.shape == (3, num_tokens) and rows.tolist() == tokens.tolist()
    assert all(rows[i].data_ptr() % 16 == 0 and rows[i].is_contiguous() for i in range(3))


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, -1, 2, 3], [1, 0, 3, 2], [0, 1, 2], [2, -1, 0, -1, 1]])
def test_fed_tokens_replace_exactly_the_rows_that_point_at_the_last_step(rows):
    """Input id i becomes the last step's token rows[i] where rows[i] >= 0 and stays otherwise; the identity (the
    steady decode step) takes its one-copy path to the same result."""
    prev = torch.arange(70, 74)  # the last step's four sampled tokens
    ids = torch.arange(10, 10 + len(rows))
    want = torch.tensor([int(prev[r]) if r >= 0 else 10 + i for i, r in enumerate(rows)])
    feed_device_tokens(ids, (np.asarray(rows, dtype=np.int64), prev))
    assert ids.tolist() == want.tolist()


def test_one_token_entries_lead_the_batch_in_order():
    class S:
        def __init__(self, name):
            self.name = name

    seqs = [S(c) for c in "abcdef"]
    batch = ScheduledBatch(seqs=list(seqs), num_new_tokens=[1, 30, 1, 7, 1, 1])
    _decodes_first(batch)
    assert [s.name for s in batch.seqs] == ["a", "c", "e", "f", "b", "d"]
    assert batch.num_new_tokens == [1, 1, 1, 1, 30, 7]


def naive_groups(tables, seq_lens, block_size, samples):
    """Row by row: runs of equal first blocks, cut every `samples` rows; each group's prefix the whole blocks all of
    its rows hold in the same places, before its shortest row's newest token."""
    groups, prefix_lens, b, n = [], [0] * len(seq_lens), 0, len(seq_lens)
    while b < n:
        end = b + 1
        while end < n and end - b < samples and tables[end][0] == tables[b][0]:
            end += 1
        blocks = 0
        while blocks < len(tables[b]) and all(tables[r][blocks] == tables[b][blocks] for r in range(b, end)):
            blocks += 1
        blocks = min(blocks, (min(seq_lens[b:end]) - 1) // block_size)
        if end - b > 1 and blocks > 0:
            groups.append([b, end - b, blocks * block_size])
            prefix_lens[b:end] = [blocks * block_size] * (end - b)
        b = end
    return groups, prefix_lens


@pytest.mark.parametrize("samples", [2, 4, 16])
def test_shared_prefix_groups_match_a_row_by_row_rebuild(samples):
    """The n samples of a prompt side by side share its blocks: random runs of rows with shared leading blocks and
    tails of their own, lone rows, and padding rows (table -1, length 1) like a graph's."""
    rng = np.random.default_rng(7)
    bs, width = 16, 12
    for _ in range(20):
        rows, lens, next_block = [], [], 0
        while len(rows) < 40:
            n, prompt_blocks = int(rng.integers(1, 9)), int(rng.integers(0, 5))
            prompt = list(range(next_block, next_block + prompt_blocks))
            next_block += prompt_blocks
            for _ in range(n):
                length = prompt_blocks * bs + int(rng.integers(-bs, 3 * bs))
                length = max(1, length)
                own = -(-length // bs) - prompt_blocks
                table = (prompt[: -(-length // bs)] + list(range(next_block, next_block + max(own, 0))))[:width]
                next_block += max(own, 0)
                rows.append(table + [0] * (width - len(table)))
                lens.append(length)
        rows += [[-1] * width] * 3
        lens += [1] * 3
        tables, seq_lens = np.array(rows, dtype=np.int32), np.array(lens, dtype=np.int32)
        groups, prefix_lens = shared_prefix_groups(tables, seq_lens, bs, samples)
        want_groups, want_lens = naive_groups(rows, lens, bs, samples)
        assert groups.tolist() == want_groups and prefix_lens.tolist() == want_lens
        assert groups.dtype == prefix_lens.dtype == np.int32
    lone = shared_prefix_groups(np.arange(24, dtype=np.int32).reshape(8, 3), np.full(8, 40, np.int32), bs, samples)
    assert lone[0].shape == (0, 3) and lone[1].tolist() == [0] * 8  # n = 1 traffic: no neighbours share a block


def test_cascade_decode_steps_give_the_same_outputs(tiny_models):
    """Decode steps of 64 rows, 4 prompts x n = 16 side by side, with their shared-prefix groups on (the CPU runs the
    reference attention over each row's whole table, so this checks the groups' way into the step: the metadata
    upload and RoPE before the attention) and off: the same tokens and logprobs, and the groups as the scheduler
    lays the samples out (16 rows a group, each prompt's whole blocks shared)."""
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, max_num_seqs=64, block_size=8,
              enable_prefix_caching=False)  # the second run computes its prompts again, as the first did
    runner = llm.engine.runner
    prompts = [list(range(1000 + 13 * i, 1040 + 30 * i)) for i in range(4)]  # 40 / 57 / 74 / 91 tokens
    params = SamplingParams(n=16, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=0)
    assert runner.cascade_samples == 0  # no Triton: no cascade of its own
    plain = llm.generate(prompts, params)
    runner.cascade_samples = 16
    original, seen = runner.prepare, []

    def recording(batch):
        step = original(batch)
        if step.cascade is not None:
            seen.append(step.cascade)
        return step

    runner.prepare = recording
    cascaded = llm.generate(prompts, params)
    assert seen, "no decode step took the cascade"
    groups, prefix_lens = seen[0]
    assert groups[:, 1].tolist() == [16] * 4 and groups[:, 2].tolist() == [40, 56, 72, 88]
    assert prefix_lens.tolist() == [int(g) for g in groups[:, 2] for _ in range(16)]
    for a, b in zip(plain, cascaded, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        logprobs = [[[e.logprob for e in c.logprobs] for c in out.outputs] for out in (a, b)]
        assert logprobs[0] == logprobs[1]
