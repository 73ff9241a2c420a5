"""The engine on a hybrid model (tiny random Qwen3.5: Gated DeltaNet + gated full attention), CPU fp32: greedy
outputs token-identical to transformers under 16-token chunks, mixed prompt lengths, forced preemption and
prefix caching on and off; prefix hits that restore a state snapshot; n seeded samples equal to their n = 1
twins; every state slot back in the pool at the end. The tests against transformers run on the CPU even
where CUDA is there: on a GPU an fp32 checkpoint is served in bf16, which no fp32 reference matches token for
token (the CUDA path is checked by the tests that need no reference, tests/kernels/test_gdn_gpu.py and
benchmarks/hybrid_bench.py's bf16 check against transformers in bf16)."""

import pytest
import torch

from engine_models import hf_greedy, tiny_qwen3_5
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.engine.llm_engine import LLMEngine

MAX_NEW = 12
BLOCKS = 20  # of 16 tokens: the longest request fits, all eight at once do not


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return tiny_qwen3_5(tmp_path_factory.mktemp("hybrid") / "tiny")


def prompts() -> list[list[int]]:
    """Eight prompts of 3 to 150 tokens (ids below the tiny vocabulary of 512); two share 100 tokens."""
    shared = [(7 * i + 3) % 500 + 3 for i in range(100)]
    lens = [3, 17, 150, 40, 1, 64, 90]
    out = [[(13 * i + 5 * n) % 500 + 3 for i in range(n)] for n in lens]
    return out[:3] + [shared + [11, 12, 13], shared + [21] * 30] + out[3:6]


@pytest.fixture(scope="module")
def expected(qwen3_5):
    ps = prompts()
    return ps, hf_greedy(qwen3_5, ps, MAX_NEW)


def greedy(max_tokens=MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)  # as HF's min_new_tokens


def assert_all_free(engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.state.num_free == bm.state.num_slots and not bm.state.pending_snapshots


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers_with_small_chunks_and_preemption(qwen3_5, expected, prefix_caching):
    ps, want = expected
    llm = LLM(str(qwen3_5), device="cpu", max_model_len=200, max_num_batched_tokens=16, num_gpu_blocks_override=BLOCKS,
              enable_prefix_caching=prefix_caching)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, greedy())]
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0, "the KV budget was meant to force preemption"
    assert max(s.num_prefill_tokens for s in stats.recent_steps) <= 16
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats.recent_steps), "no mixed step"
    for i, (g, e) in enumerate(zip(got, want, strict=True)):
        assert g == e, f"prompt {i} ({len(ps[i])} tokens) differs from transformers"
    assert_all_free(llm.engine)


def test_prefix_hits_restore_the_state_snapshot(qwen3_5, expected):
    ps, want = expected
    llm = LLM(str(qwen3_5), device="cpu", max_model_len=200, num_gpu_blocks_override=100)
    first = llm.generate([ps[3]], greedy())[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == want[3]
    # the prompt of 103 tokens left a snapshot at 96: a repeat hits 96, so does the prompt sharing 100 tokens;
    # a prompt sharing only two blocks (no snapshot at 32) is cut back to no hit
    other = ps[3][:40] + [5] * 20
    outs = llm.generate([ps[3], ps[4], other], greedy())
    assert [o.num_cached_tokens for o in outs] == [96, 96, 0]
    assert outs[0].outputs[0].token_ids == want[3] and outs[1].outputs[0].token_ids == want[4]
    assert outs[2].outputs[0].token_ids == hf_greedy(qwen3_5, [other], MAX_NEW)[0]
    assert llm.engine.stats().prefix_cache_hits_total >= 192
    llm.engine.block_manager.reset_prefix_cache()  # the snapshots go with their blocks
    assert not llm.engine.block_manager.state.snapshot_of
    assert llm.generate([ps[3]], greedy())[0].num_cached_tokens == 0
    assert_all_free(llm.engine)


def test_n4_seeded_samples_equal_their_n1_twins(qwen3_5):
    llm = LLM(str(qwen3_5), max_model_len=200, max_num_batched_tokens=32, num_gpu_blocks_override=60)
    prompt = [(11 * i + 7) % 500 + 3 for i in range(45)]  # 45 tokens: two chunks, then the fork
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    group = llm.generate(prompt, params)[0]
    singles = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=10, ignore_eos=True))[0]
               for i in range(4)]
    for i in range(4):
        assert group.outputs[i].token_ids == singles[i].outputs[0].token_ids, f"sample {i}"
    assert len({tuple(o.token_ids) for o in group.outputs}) > 1  # seeds differ, so samples differ
    assert_all_free(llm.engine)


def test_abort_frees_the_state_slot_and_samples_beyond_the_slots_are_refused(qwen3_5):
    llm = LLM(str(qwen3_5), max_model_len=200, max_num_seqs=4, num_gpu_blocks_override=40)
    engine = llm.engine
    assert engine.block_manager.state.num_slots == 4
    engine.add_request("a", list(range(10, 50)), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=30))
    engine.step()
    engine.step()
    assert engine.block_manager.state.num_free == 2
    engine.abort_request("a")
    assert_all_free(engine)
    with pytest.raises(ValueError, match="state slot"):
        engine.add_request("b", [5, 6, 7], SamplingParams(n=5))


def test_startup_error_counts_the_state_slots(qwen3_5):
    # ~11 KB a slot x (256 sequences + 64 snapshots) leave nothing of a 2 MB budget for the KV cache
    with pytest.raises(ValueError, match="state slots"):
        LLMEngine(EngineConfig(model=str(qwen3_5), max_model_len=200, kv_cache_memory_bytes=2 << 20, device="cpu"))


def test_recurrent_state_dtype_follows_the_flag_then_the_checkpoint(qwen3_5, tmp_path):
    """--mamba-ssm-cache-dtype: the flag wins, then the checkpoint's mamba_ssm_dtype, then the model dtype (vLLM's
    rule). A bf16 state is half the fp32 one and serves logprobs near the fp32 state's; a bad value is refused."""
    ps = prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(path, **kw):
        llm = LLM(str(path), device="cpu", max_model_len=200, num_gpu_blocks_override=60, **kw)
        outs = [o.outputs[0] for o in llm.generate(ps, params)]
        return llm.engine.runner.state, [[e.logprob for e in o.logprobs] for o in outs], [o.token_ids for o in outs]

    fp32_state, fp32_lp, fp32_tokens = run(qwen3_5)
    assert fp32_state.ssm.dtype == torch.float32  # an fp32 model, no mamba_ssm_dtype in its config
    bf16_state, bf16_lp, _ = run(qwen3_5, mamba_ssm_cache_dtype="bfloat16")
    assert bf16_state.ssm.dtype == torch.bfloat16 and 2 * bf16_state.ssm.nbytes == fp32_state.ssm.nbytes
    # the first token's logprob comes from the prompt's state as written by the prefill, the rest from decodes
    # over a state rounded to bf16 at every step: near, never equal
    diffs = [abs(a - b) for row_a, row_b in zip(fp32_lp, bf16_lp) for a, b in zip(row_a, row_b)]
    assert max(diffs) < 0.05 and sum(diffs) > 0, max(diffs)

    import json
    import shutil
    asked = tmp_path / "asks-bf16"
    shutil.copytree(qwen3_5, asked)
    config = json.loads((asked / "config.json").read_text())
    (asked / "config.json").write_text(json.dumps({**config, "mamba_ssm_dtype": "bfloat16"}))
    assert run(asked)[0].ssm.dtype == torch.bfloat16
    overridden, _, tokens = run(asked, mamba_ssm_cache_dtype="float32")
    assert overridden.ssm.dtype == torch.float32 and tokens == fp32_tokens
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        LLM(str(qwen3_5), device="cpu", mamba_ssm_cache_dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_tokens(qwen3_5):
    """On CUDA the DeltaNet kernels capture (no host syncs): decode, prompt and mixed steps replay graphs, whose
    padding rows (slot -1) read and write no state, and give the eager path's tokens, with logprobs as near
    transformers in fp32 as the eager path's."""
    llm = LLM(str(qwen3_5), dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4,
              gpu_memory_fraction=0.2, enable_prefix_caching=False)
    runner = llm.engine.runner
    kinds = (runner.graphs, runner.prompt_graphs, runner.mixed_graphs)
    assert all(k is not None for k in kinds)
    ps = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=0)
              for i in range(len(ps))]

    def run():
        outs = [o.outputs[0] for o in llm.generate(ps, params)]
        return [o.token_ids for o in outs], [[e.logprob for e in o.logprobs] for o in outs]

    graphed = run()
    assert all(k.replays > 0 for k in kinds), [k.replays for k in kinds]
    runner.graphs = runner.prompt_graphs = runner.mixed_graphs = None
    eager = run()
    assert graphed[0] == eager[0]
    # The decode graphs run other kernels than an eager step (the skinny GEMV for a few rows), so bf16 rounds
    # differently there: on the H200 graphed and eager logprobs differ by up to 0.040 nats (0.0 with the decode
    # graphs off), and both are as near transformers in fp32 (max 0.238 / 0.239, mean 0.0386 / 0.0389 nats). A
    # padding row that reads or writes a state, or a logit taken from the wrong row, moves them by nats.
    diffs = [abs(a - b) for g, e in zip(graphed[1], eager[1], strict=True) for a, b in zip(g, e, strict=True)]
    assert max(diffs) <= 0.1
    ref = fp32_logprobs(qwen3_5, ps, eager[0])
    errors = [[abs(a - b) for o, r in zip(side[1], ref, strict=True) for a, b in zip(o, r, strict=True)]
              for side in (graphed, eager)]
    (graphed_max, graphed_mean), (eager_max, eager_mean) = [(max(e), sum(e) / len(e)) for e in errors]
    assert graphed_mean <= 1.1 * eager_mean + 0.005, (graphed_mean, eager_mean)
    assert graphed_max <= 1.25 * eager_max + 0.02, (graphed_max, eager_max)
    assert_all_free(llm.engine)


def fp32_logprobs(folder, prompts_, outputs) -> list[list[float]]:
    """transformers' fp32 logprob of each output token after its prompt and the tokens before it (on CUDA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    out = []
    for prompt, tokens in zip(prompts_, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        out.append([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])
    return out


def test_prompt_logprobs_match_transformers_on_the_hybrid(qwen3_5):
    """Prompt logprobs through the DeltaNet layers' chunks, with the prefix cache (and its state snapshots) holding
    the same prompts: a scored prompt runs in full."""
    from test_prompt_logprobs import check, hf_prompt_logprobs

    ps = [p for p in prompts() if len(p) > 1]
    expected = hf_prompt_logprobs(qwen3_5, ps)
    llm = LLM(str(qwen3_5), device="cpu", max_model_len=200, max_num_batched_tokens=16, num_gpu_blocks_override=BLOCKS)
    scored = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, prompt_logprobs=2)
    outs = llm.generate(ps + ps, [greedy()] * len(ps) + [scored] * len(ps))
    assert llm.engine.stats().num_preemptions_total > 0, "the KV budget was meant to force preemption"
    for i, prompt in enumerate(ps):
        check(outs[len(ps) + i].prompt_logprobs, prompt, expected[i], 2)
        assert outs[len(ps) + i].outputs[0].token_ids == outs[i].outputs[0].token_ids
    assert_all_free(llm.engine)
