"""Mixed graphs (worker/executor/graphs/mixed.py) on CPU: the staged, padded buffers and the graph manager's
choice give the same tokens as eager steps that mix decodes with prompt chunks. A stand-in replays each graph's
forward eagerly, since CPU has no CUDA graphs; tests/executor/test_engine_gpu.py captures real ones. The engines
are pinned to the CPU, so a GPU machine runs these as CI does (fp32, no memory taken from the GPU tests)."""

import numpy as np
import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.sampling_params import StructuredOutputsParams
from pagefleet.worker.executor.graphs.manager import GRAPH_RESERVE_BYTES, reserve_bytes
from pagefleet.worker.executor.graphs.mixed import MAX_CHUNKS, MixedGraphs, graph_keys
from pagefleet.worker.executor.graphs.prompt import MAX_SEQS
from pagefleet.worker.executor.step_inputs import StepInputs


class EagerGraph:
    """What a captured graph would replay: the key's forward over the static buffers."""

    def __init__(self, graphs: MixedGraphs, key):
        self.graphs, self.key = graphs, key

    def replay(self):
        self.graphs._forward(self.key, False)


def with_mixed_graphs(llm: LLM) -> MixedGraphs:
    runner = llm.engine.runner
    mg = MixedGraphs.for_config(runner.model, runner.device, llm.engine.config, runner.max_model_len,
                                runner.max_blocks_per_seq)  # as bring-up builds them
    mg.graphs = {k: EagerGraph(mg, k) for k in mg.keys}
    runner.mixed_graphs = mg
    return mg


def shape(num_decodes: int, chunks: list[int]) -> StepInputs:
    """A step of num_decodes one-token entries ahead of prompt chunks of these lengths, for `fits`."""
    counts = [1] * num_decodes + chunks
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return StepInputs(np.zeros((3, int(cu[-1])), dtype=np.int64), np.array(counts, dtype=np.int32), cu,
                      np.zeros((len(counts), 4), dtype=np.int32), [], num_decodes if chunks else 0)


def test_keys_and_reserve():
    keys = graph_keys(256, 1024)
    assert len(keys) == 32 and keys[-1] == (64, 1024)
    assert graph_keys(12, 256) == [(8, 64), (8, 128), (8, 256), (12, 64), (12, 128), (12, 256)]
    assert graph_keys(256, 48) == []
    no_prompt_graphs = EngineConfig(max_num_seqs=256, max_num_batched_tokens=48)
    assert MixedGraphs.reserve_bytes(no_prompt_graphs, 1000, torch.float32, 10**6) == 0  # no mixed ones either
    # 64 padded decodes past the largest prompt graph's 1,024 rows, at the profiled 8,192-token step's rate
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    mixed = MixedGraphs.reserve_bytes(config, 1000, torch.float32, 8192 * 10)
    assert mixed == 64 * 10 + (64 + MAX_CHUNKS) * 1000 * 4
    # the manager's reserve: the pool and workspace, each kind's static logits and activations; none when eager
    decode_logits, prompt = 256 * 1000 * 4, 1024 * 10 + MAX_SEQS * 1000 * 4
    assert reserve_bytes(config, 1000, torch.float32, 8192 * 10) == GRAPH_RESERVE_BYTES + decode_logits + prompt + mixed
    config.enforce_eager = True
    assert reserve_bytes(config, 1000, torch.float32, 8192 * 10) == 0


def test_stage_pads_decodes_and_prompt_tokens(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=512, max_num_batched_tokens=256, max_num_seqs=16,
              device="cpu")
    mg = with_mixed_graphs(llm)
    assert mg.fits(shape(16, [16] * MAX_CHUNKS)) and not mg.fits(shape(17, [8]))
    assert not mg.fits(shape(1, [2] * (MAX_CHUNKS + 1)))
    assert not mg.fits(shape(16, [257])) and not mg.fits(shape(0, [8])) and not mg.fits(shape(3, []))
    # two decodes (context 9 and 17), then chunks of 3 and 2 tokens
    tokens = np.array([[11, 12, 5, 6, 7, 8, 9], [8, 16, 0, 1, 2, 4, 5], [40, 41, 48, 49, 50, 64, 65]], dtype=np.int64)
    seq_lens, cu = np.array([9, 17, 3, 6], dtype=np.int32), np.array([0, 1, 2, 5, 7], dtype=np.int32)
    tables = np.array([[2, 0, 0, 0], [3, 4, 0, 0], [5, 0, 0, 0], [6, 7, 0, 0]], dtype=np.int32)
    assert mg.stage(StepInputs(tokens, seq_lens, cu, tables, [0, 1, 4, 6], 2)) == (8, 64)
    got = mg.tokens[:, :72].numpy()
    assert (got[:, :2] == tokens[:, :2]).all() and (got[:, 8:13] == tokens[:, 2:]).all()
    assert (got[2, 2:8] == -1).all() and (got[2, 13:] == -1).all()  # padding rows and tokens write nowhere
    assert mg.dec_seq_lens[:8].tolist() == [9, 17, 1, 1, 1, 1, 1, 1]  # a padding decode sees one key
    assert mg.dec_tables[:2, :4].tolist() == [[2, 0, 0, 0], [3, 4, 0, 0]] and mg.dec_tables[2:].abs().sum() == 0
    assert mg.seq_lens.tolist() == [3, 6] + [0] * (MAX_CHUNKS - 2)
    assert mg.cu_seqlens_q.tolist() == [0, 3] + [5] * (MAX_CHUNKS - 1)  # padding sequences own no tokens
    assert mg.block_tables[:2, :4].tolist() == [[5, 0, 0, 0], [6, 7, 0, 0]] and mg.block_tables[2:].abs().sum() == 0
    assert mg.logits_rows[:4].tolist() == [0, 1, 10, 12]
    for part in (mg.dec_seq_lens, mg.dec_tables, mg.seq_lens, mg.cu_seqlens_q, mg.block_tables):
        assert part.data_ptr() % 16 == 0  # each part 16-byte aligned (a Triton variant per alignment)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_graphed_mixed_steps_match_eager(tiny_models, arch, logprobs):
    """Four sequences at a time, ending at different lengths: each waiting prompt joins the decodes of the
    others as a slot frees, in a mixed step of 1-3 decodes and one prompt (a 250-token one chunked, its
    first chunk past the largest bucket: eager). Without logprobs the steps overlap, and the decodes read
    their last token from the device into the padded rows."""
    lengths = [40, 20, 50, 30, 7, 25, 60, 250, 12, 64, 65]
    prompts = [list(range(200 + 11 * i, 200 + 11 * i + n)) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True, logprobs=logprobs)
              for i in range(len(prompts))]
    settings = dict(max_model_len=512, max_num_batched_tokens=200, max_num_seqs=4, device="cpu")
    eager_llm, llm = LLM(str(tiny_models[arch]), **settings), LLM(str(tiny_models[arch]), **settings)
    mg = with_mixed_graphs(llm)
    assert mg.keys == [(4, 64), (4, 128)]
    eager, graphed = eager_llm.generate(prompts, params), llm.generate(prompts, params)
    for e, g in zip(eager, graphed, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.outputs[0].logprobs or [], g.outputs[0].logprobs or [], strict=True):
            assert abs(lg.logprob - le.logprob) < 1e-4 and [t for t, _ in lg.top] == [t for t, _ in le.top]
    mixed = [s for s in llm.engine.recent_steps if s.num_decode_tokens and s.num_prefill_tokens]
    assert 5 <= mg.replays < len(mixed), (mg.replays, len(mixed))  # the 250-token prompt's first chunk: eager


def test_graphed_mixed_steps_fork_samples(tiny_models):
    """A request with n=3 seeded samples forks off a prompt that finished in a graphed mixed step."""
    settings = dict(max_model_len=512, max_num_batched_tokens=136, max_num_seqs=8, device="cpu")
    eager_llm, llm = LLM(str(tiny_models["llama"]), **settings), LLM(str(tiny_models["llama"]), **settings)
    mg = with_mixed_graphs(llm)
    prompts = [list(range(300, 420)), list(range(500, 530))]  # the second prompt's last 14 tokens: beside a decode
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)]
    eager, graphed = eager_llm.generate(prompts, params), llm.generate(prompts, params)
    assert [[o.token_ids for o in r.outputs] for r in graphed] == [[o.token_ids for o in r.outputs] for r in eager]
    assert mg.keys == [(8, 64), (8, 128)] and len(graphed[1].outputs) == 3 and mg.replays == 1


def test_mixed_graphs_take_many_forced_chunks(tiny_models):
    """Structured outputs' jump-forward (engine/step.py), twelve constrained sequences at once: steps carry more
    forced chunks than a prompt graph holds, never more than the mixed graphs hold (the scheduler runs the
    others a token at a time), replayed with the eager engine's tokens."""
    settings = dict(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16,
                    structured_outputs_jump_forward=True, device="cpu")
    eager_llm, llm = LLM(str(tiny_models["llama"]), **settings), LLM(str(tiny_models["llama"]), **settings)
    mg = with_mixed_graphs(llm)
    llm.engine.scheduler.max_chunks = mg.max_chunks  # as the engine sets it over captured graphs
    chunks = []
    real_stage = mg.stage

    def stage(step, feed=None):
        chunks.append(step.num_seqs - step.num_decodes)
        return real_stage(step, feed)

    mg.stage = stage
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(12)]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=60,
                            structured=StructuredOutputsParams(json={"type": "object", "properties": {
                                "first_name": {"type": "string", "maxLength": 4},
                                "family_name": {"type": "string", "maxLength": 4},
                                "is_member": {"type": "boolean"}},
                                "required": ["first_name", "family_name", "is_member"],
                                "additionalProperties": False}))
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    want = [o.outputs[0] for o in eager_llm.generate(prompts, params)]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert max(chunks) > MAX_SEQS and max(chunks) <= MAX_CHUNKS, chunks
    assert np.mean([c.finish_reason == "stop" for c in got]) > 0.5
