"""Prompt graphs (worker/executor/graphs/prompt.py) on CPU: the staged, padded buffers and the runner's routing give the
same tokens as eager prompt steps. A stand-in replays each bucket's forward eagerly, since CPU has no CUDA
graphs; tests/executor/test_engine_gpu.py captures real ones."""

import numpy as np
import pytest

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.executor.graphs.prompt import BUCKETS, MAX_SEQS, PromptGraphs, prompt_graph_bytes, token_buckets


class EagerGraph:
    """What a captured graph would replay: the bucket's forward over the static buffers."""

    def __init__(self, graphs: PromptGraphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    def replay(self):
        self.graphs._forward(self.bucket, False)


def with_prompt_graphs(llm: LLM) -> PromptGraphs:
    runner = llm.engine.runner
    pg = PromptGraphs(runner.model, runner.device, token_buckets(llm.engine.config.max_num_batched_tokens), runner.max_blocks_per_seq)
    pg.graphs = {t: EagerGraph(pg, t) for t in pg.buckets}
    runner.prompt_graphs = pg
    return pg


def test_buckets_and_fits():
    assert token_buckets(8192) == list(BUCKETS) and token_buckets(300) == [64, 128, 192, 256] and token_buckets(48) == []
    assert prompt_graph_bytes(10**9, 48, 1000, np.dtype("float32")) == 0


def test_stage_pads_tokens_sequences_and_tables(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=512, max_num_batched_tokens=300, max_num_seqs=8)
    pg = with_prompt_graphs(llm)
    assert pg.fits(MAX_SEQS, 256) and not pg.fits(MAX_SEQS + 1, 10) and not pg.fits(1, 257)
    tokens = np.array([[5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [32, 33, 34, 48, 49]], dtype=np.int64)
    seq_lens, cu = np.array([3, 2], dtype=np.int32), np.array([0, 3, 5], dtype=np.int32)
    tables = np.array([[2, 0, 0, 0], [3, 0, 0, 0]], dtype=np.int32)
    assert pg.stage(tokens, seq_lens, cu, tables, [2, 4]) == 64
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
    groups = [[list(range(100 + 7 * i + j, 100 + 7 * i + j + n)) for j, n in enumerate(g)] for i, g in enumerate(lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    settings = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)
    eager_llm, llm = LLM(str(tiny_models[arch]), **settings), LLM(str(tiny_models[arch]), **settings)
    pg = with_prompt_graphs(llm)
    for prompts in groups:
        eager, graphed = eager_llm.generate(prompts, params), llm.generate(prompts, params)
        for e, g in zip(eager, graphed):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
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
        assert graphed.num_cached_tokens == eager.num_cached_tokens == (0 if round_ == 0 else 96)  # whole 16-token blocks
    assert pg.replays == 2
