"""The step inputs (worker/executor/step_inputs.py, built with numpy over the whole batch) against a per-sequence
rebuild, and their uploads' alignment."""

import numpy as np
import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.scheduler import ScheduledBatch, _decodes_first
from pagefleet.worker.executor.step_inputs import feed_device_tokens, upload_int32, upload_rows


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
