"""Prompt graphs (worker/executor/graphs/prompt.py) on CPU: the staged, padded buffers and the graph manager's
choice give the same tokens as eager prompt steps. A stand-in replays each bucket's forward eagerly, since CPU
has no CUDA graphs; tests/executor/test_engine_gpu.py captures real ones."""

import numpy as np
import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.executor.graphs.prompt import BUCKETS, MAX_SEQS, PromptGraphs, token_buckets
from pagefleet.worker.executor.step_inputs import StepInputs


class EagerGraph:
    """What a captured graph would replay: the bucket's forward over the static buffers."""

    def __init__(self, graphs: PromptGraphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self):
        self.graphs._forward(self.bucket, False)


def with_prompt_graphs(llm: LLM) -> PromptGraphs:
    runner = llm.engine.runner
    pg = PromptGraphs.for_config(runner.model, runner.device, llm.engine.config, runner.max_model_len,
                                 runner.max_blocks_per_seq)  # as bring-up builds them
    pg.graphs = {t: EagerGraph(pg, t) for t in pg.buckets}
    runner.prompt_graphs = pg
    return pg


def shape(counts: list[int], num_decodes: int = 0) -> StepInputs:
    """A step of these per-sequence token counts, for `fits` (only its shape matters)."""
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return StepInputs(np.zeros((3, int(cu[-1])), dtype=np.int64), np.array(counts, dtype=np.int32), cu,
                      np.zeros((len(counts), 4), dtype=np.int32), [], num_decodes)


def test_buckets_and_reserve():
    assert token_buckets(8192) == list(BUCKETS) and token_buckets(300) == [64, 128, 192, 256]
    assert token_buckets(48) == []
    assert PromptGraphs.reserve_bytes(EngineConfig(max_num_batched_tokens=48), 1000, torch.float32, 10**9) == 0
    # the largest bucket's share (1,024 of 8,192 tokens) of the activations, and the static logits of 4 rows
    reserve = PromptGraphs.reserve_bytes(EngineConfig(max_num_batched_tokens=8192), 1000, torch.float32, 8192 * 10)
    assert reserve == 1024 * 10 + MAX_SEQS * 1000 * 4


def test_stage_pads_tokens_sequences_and_tables(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=512, max_num_batched_tokens=300, max_num_seqs=8)
    pg = with_prompt_graphs(llm)
    assert pg.fits(shape([64] * MAX_SEQS)) and pg.fits(shape([200, 56]))
    assert not pg.fits(shape([2] * (MAX_SEQS + 1))) and not pg.fits(shape([257]))
    assert not pg.fits(shape([1, 30], num_decodes=1)) and not pg.fits(shape([1, 1]))  # decodes: not prompt-only
    tokens = np.array([[5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [32, 33, 34, 48, 49]], dtype=np.int64)
    seq_lens, cu = np.array([3, 2], dtype=np.int32), np.array([0, 3, 5], dtype=np.int32)
    tables = np.array([[2, 0, 0, 0], [3, 0, 0, 0]], dtype=np.int32)
    step = StepInputs(tokens, seq_lens, cu, tables, [2, 4], 0)
    assert pg.stage(step) == 64
    got = pg.tokens[:, :64].numpy()
    assert (got[:, :5] == tokens).all() and (got[2, 5:] == -1).all()  # padding tokens write nowhere
    assert pg.seq_lens.tolist() == [3, 2, 0, 0]
    assert pg.cu_seqlens_q.tolist() == [0, 3, 5, 5, 5]  # padding sequences own no tokens
    assert pg.block_tables[:2, :4].tolist() == [[2, 0, 0, 0], [3, 0, 0, 0]] and pg.block_tables[2:].abs().sum() == 0
    assert pg.logits_rows.tolist() == [2, 4, 0, 0]
    # each part of the int32 buffer starts 16-byte aligned (a Triton variant per alignment)
    for part in (pg.seq_lens, pg.cu_seqlens_q, pg.block_tables):
        assert part.data_ptr() % 16 == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphed_prompt_steps_match_eager(tiny_models, arch):
    """Requests in groups, so prompt-only steps of 1-4 sequences come up: a bucket exactly full (64), one
    token over (65), a 400-token prompt whose first 256-token chunk samples nothing, a group over the
    largest bucket (eager), and a group of five (eager: more sequences than a graph holds)."""
    lengths = [[5], [64], [65, 3], [400], [200, 57, 31], [120, 130, 7], [9, 8, 7, 6], [3, 4, 5, 6, 7]]
    groups = [[list(range(100 + 7 * i + j, 100 + 7 * i + j + n)) for j, n in enumerate(g)]
              for i, g in enumerate(lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    settings = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)
    eager_llm, llm = LLM(str(tiny_models[arch]), **settings), LLM(str(tiny_models[arch]), **settings)
    pg = with_prompt_graphs(llm)
    for prompts in groups:
        eager, graphed = eager_llm.generate(prompts, params), llm.generate(prompts, params)
        for e, g in zip(eager, graphed, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert abs(lg.logprob - le.logprob) < 1e-4 and [t for t, _ in lg.top] == [t for t, _ in le.top]
    assert pg.replays >= len(groups) - 1  # every group's first step but the group of five, and the 400's chunks


def test_graphed_prompt_steps_fork_samples_and_hit_the_prefix_cache(tiny_models):
    """A GRPO-style request (n=4, seeded sampling) forks its samples off a graphed prompt step's one logits
    row; the same prompt again hits the prefix cache, so its graphed step computes only the uncached tail
    against cached keys. Both give the eager engine's tokens."""
    settings = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8, enable_prefix_caching=True)
    eager_llm, llm = LLM(str(tiny_models["llama"]), **settings), LLM(str(tiny_models["llama"]), **settings)
    pg = with_prompt_graphs(llm)
    prompt = list(range(300, 300 + 100))
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    for round_ in range(2):
        eager, graphed = eager_llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
        assert len(graphed.outputs) == 4
        assert [o.token_ids for o in graphed.outputs] == [o.token_ids for o in eager.outputs]
        # whole 16-token blocks
        assert graphed.num_cached_tokens == eager.num_cached_tokens == (0 if round_ == 0 else 96)
    assert pg.replays == 2
