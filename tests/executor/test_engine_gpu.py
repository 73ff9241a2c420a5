"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers in fp32; skipped without a GPU.

benchmarks/gpu_bench.py runs the same comparison on 8B-shaped checkpoints; this is the small, quick one. One
file past 300 lines: every CUDA-only path of the engine (graph kinds, FP8, compile workers) in the one run the
H200 gives them.
"""

import re

import pytest
import torch

from pagefleet.kernels import pdl
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.executor.graphs.decode import DecodeGraphs
from pagefleet.worker.executor.startup import compile_workers as precompile
from pagefleet.worker.models.layers import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


PROMPTS = [list(range(1000, 1000 + n)) for n in (150, 20, 300, 7)]


@pytest.fixture(autouse=True)
def no_compile_workers(request, monkeypatch):
    """Engines here compile in their own process: this file's many small engines, each with its own settings,
    would each wait on workers that find the cache mostly filled. test_compile_workers_* use them."""
    if not request.node.name.startswith("test_compile_workers"):
        monkeypatch.setattr(precompile, "start", lambda *args: None)


def forget_compiled_kernels():
    """Drop the variants earlier tests compiled in this process: the next engine must compile (or load
    from disk) every one it needs."""
    import importlib

    from triton.runtime.jit import JITFunction

    for name in ("activation", "attention", "cascade", "fp8", "gemv", "greedy", "kv_cache", "norm",
                 "prefill_attention", "rope", "sampling"):
        module = importlib.import_module(f"pagefleet.kernels.{name}")
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()


def record_compiles(monkeypatch) -> list[tuple[str, str]]:
    """From here on, each Triton kernel variant this process compiles: (kernel name, the start of its key)."""
    from triton.runtime.jit import JITFunction

    compiled = []
    do_compile = JITFunction._do_compile

    def recording(self, key, *args, **kwargs):
        compiled.append((self.fn.__name__, str(key)[:200]))
        return do_compile(self, key, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", recording)
    return compiled


def chosen_logprobs(model, prompt, tokens):
    """transformers' logprob of each generated token after prompt + the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return rows.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)


def generate_mixed(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0))
    steps = llm.engine.recent_steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step mixed chunks and decodes"
    return outs


def transformers_pair(path):
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    return hf32, hf16


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_logprobs_match_transformers_with_chunks_mixed_into_decodes(tiny_models, arch, enforce_eager):
    path = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=32, max_num_seqs=8,
              enforce_eager=enforce_eager, gpu_memory_fraction=0.2)
    assert_near_transformers(path, PROMPTS, generate_mixed(llm))


def assert_near_transformers(path, prompts, outs):
    """Each output's logprobs "within bf16 tolerance" of transformers in fp32: no worse than twice what
    transformers itself loses in bf16."""
    hf32, hf16 = transformers_pair(path)
    for p, out in zip(prompts, outs, strict=True):
        toks = out.outputs[0].token_ids
        ref = chosen_logprobs(hf32, p, toks)
        hf_bf16_error = (chosen_logprobs(hf16, p, toks) - ref).abs().max().item()
        ours = torch.tensor([e.logprob for e in out.outputs[0].logprobs], device="cuda")
        assert (ours - ref).abs().max().item() <= max(2 * hf_bf16_error, 0.05)


def test_cascade_decode_steps_near_transformers(tiny_models, monkeypatch):
    """Eager decode steps of 64 rows, 4 prompts x n = 16: the samples of each prompt read its shared blocks once a
    group (kernels/cascade.py), and the logprobs stay within the bf16 bound of transformers. The start-up warm-up
    compiled both of the cascade's launches: none compiles mid-run."""
    path = tiny_models["llama"]
    forget_compiled_kernels()
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=64, enforce_eager=True,
              gpu_memory_fraction=0.2)
    compiled = record_compiles(monkeypatch)
    runner = llm.engine.runner
    config = runner.model_config  # 64 rows a program: samples x the query heads of a KV head (rounded up)
    assert runner.cascade_samples == 64 // (config.num_attention_heads // config.num_key_value_heads)
    original, cascaded = runner.prepare, []

    def recording(batch):
        step = original(batch)
        cascaded.append(step.cascade is not None)
        return step

    runner.prepare = recording
    prompts = [list(range(1000 + 13 * i, 1040 + 30 * i)) for i in range(4)]  # 40 / 57 / 74 / 91 tokens
    outs = llm.generate(prompts, SamplingParams(n=16, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert sum(cascaded) >= 6  # every decode step of the 64 rows
    assert all(len({tuple(c.token_ids) for c in out.outputs}) == 1 for out in outs)  # greedy: one answer a prompt
    assert not [c for c in compiled if c[0] in ("_prefix_kernel", "_decode_kernel")], compiled
    assert_near_transformers(path, prompts, outs)


def test_bf16_decode_graphs_of_17_to_32_sequences_through_the_gemv(tiny_models, monkeypatch, folded_rows):
    """bf16 decode graphs with the GEMV limit at 32 rows (the arm rows32 of benchmarks/decode_graphs_ab.py):
    24 sequences replay the 32-row graph, its linears our GEMV with the norms folded in."""
    monkeypatch.setattr(ops, "SKINNY_MAX_ROWS", 32)
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=32,
              gpu_memory_fraction=0.2)
    assert 32 in folded_rows and 48 not in folded_rows  # captured through the GEMV at 32 rows, not past
    prompts = [list(range(1000 + 13 * i, 1005 + 20 * i)) for i in range(24)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert any(s.num_decode_tokens == 24 and not s.num_prefill_tokens for s in llm.engine.recent_steps)
    assert_near_transformers(path, prompts, outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_logprobs_near_transformers(tiny_models, arch):
    """--quantization fp8 with graphs: prompt chunks through torch._scaled_mm, decode graphs through the
    e4m3 GEMV, norms folded before quantising; near transformers as assert_fp8_near_transformers bounds it."""
    from pagefleet.worker.models.layers.fp8 import Fp8Linear

    path = tiny_models[arch]
    llm = LLM(str(path), dtype="bfloat16", quantization="fp8", max_model_len=512, max_num_batched_tokens=32,
              max_num_seqs=8, gpu_memory_fraction=0.2)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.model.norms_folded
    assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    outs = generate_mixed(llm)
    assert_fp8_near_transformers(path, PROMPTS, outs)


def assert_fp8_near_transformers(path, prompts, outs):
    """e4m3 keeps 3 mantissa bits to bf16's 7: the mean error of the chosen tokens' logprobs against
    transformers in fp32 is at most 16x what transformers loses in bf16, and at least 0.1."""
    hf32, hf16 = transformers_pair(path)
    ours, hf_bf16, ref = [], [], []
    for p, out in zip(prompts, outs, strict=True):
        toks = out.outputs[0].token_ids
        ref.append(chosen_logprobs(hf32, p, toks))
        hf_bf16.append(chosen_logprobs(hf16, p, toks))
        ours.append(torch.tensor([e.logprob for e in out.outputs[0].logprobs], device="cuda"))
    ref, hf_bf16, ours = torch.cat(ref), torch.cat(hf_bf16), torch.cat(ours)
    error, hf_error = (ours - ref).abs().mean().item(), (hf_bf16 - ref).abs().mean().item()
    assert error <= max(16 * hf_error, 0.1), (error, hf_error)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp8_kv_cache_near_transformers(tiny_models, quantization, enforce_eager):
    """--kv-cache-dtype fp8: keys and values in e4m3, written by RoPE's kernel and the decode launch, read by the
    decode, prefill and mixed kernels, in graphs and eagerly; near transformers as e4m3 weights are."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs Ada or Hopper")
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="bfloat16", quantization=quantization, kv_cache_dtype="fp8", max_model_len=512,
              max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=enforce_eager, gpu_memory_fraction=0.2)
    assert llm.engine.runner.kv.data.dtype == torch.float8_e4m3fn
    assert (llm.engine.runner.graphs is None) == enforce_eager
    assert_fp8_near_transformers(path, PROMPTS, generate_mixed(llm))


def test_fp8_quantised_rows_change_nothing(tiny_models):
    """FP8 prompt steps with the norms and SiLU*mul quantising for the e4m3 GEMMs (ops.Fp8Rows) give bit for
    bit the tokens and logprobs of each GEMM quantising its own input."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", quantization="fp8", max_model_len=512,
              max_num_batched_tokens=64, max_num_seqs=8, gpu_memory_fraction=0.2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)

    def run():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]

    fused = run()
    llm.engine.runner.model.fuse_fp8_quantisation = False
    assert run() == fused


def test_fp8_decode_graphs_past_32_rows_through_the_fp8_gemm(tiny_models, monkeypatch):
    """FP8 decode graphs of 33..64 rows capture their linears as kernels/fp8_skinny.py's GEMM (e4m3 on both
    sides), and 40 sequences decoding together stay as near transformers as the FP8 bound above allows."""
    from pagefleet.kernels import fp8_skinny

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    rows, real = [], fp8_skinny.fp8_skinny_gemm
    monkeypatch.setattr(fp8_skinny, "fp8_skinny_gemm",
                        lambda xq, *a, **k: rows.append(xq.shape[0]) or real(xq, *a, **k))
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="bfloat16", quantization="fp8", max_model_len=512, max_num_batched_tokens=1024,
              max_num_seqs=48, gpu_memory_fraction=0.2)
    assert 48 in rows  # the 48-row decode graph captured it (and the 64-token prompt and mixed buckets)
    prompts = [list(range(1000 + 13 * i, 1005 + 20 * i)) for i in range(40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert any(s.num_decode_tokens == 40 and not s.num_prefill_tokens for s in llm.engine.recent_steps)
    assert_fp8_near_transformers(path, prompts, outs)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_pdl_decode_graphs_match_plain_ones(tiny_models, monkeypatch, quantization):
    """Decode graphs whose GEMVs and attention launch with programmatic dependent launch (kernels/pdl.py,
    on by default on Hopper) give bit for bit the tokens and logprobs of graphs captured without it: each
    program waits for the kernel ahead of it."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper")
    assert pdl.ENABLED
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", quantization=quantization, max_model_len=512,
              max_num_batched_tokens=512, max_num_seqs=16, gpu_memory_fraction=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)

    def run():
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert sum(1 for s in llm.engine.recent_steps if s.num_decode_tokens and not s.num_prefill_tokens) >= 10
        return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]

    with_pdl = run()
    runner = llm.engine.runner
    monkeypatch.setattr(pdl, "ENABLED", False)
    runner.graphs = DecodeGraphs(runner.model, runner.device, runner.graphs.sizes, runner.graphs.max_model_len,
                                 runner.max_blocks_per_seq)
    runner.graphs.capture()
    assert run() == with_pdl


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_prompt_graphs_match_the_eager_path(tiny_models, monkeypatch, quantization):
    """Prompt-only steps of up to 4 sequences and 1,024 tokens replay a captured graph
    (worker/executor/graphs/prompt.py), padded to their bucket, a chunk that samples nothing among them. They give
    the eager path's tokens and logprobs (on the H200: bit for bit; the bound leaves room for a GEMM that picks
    another algorithm at the padded row count, not for a padding row that writes K/V or a logit taken from the
    wrong row), and nothing compiles after start-up. The eager path itself is held to transformers by the tests
    above. Every kind's graphs are in the one pool the decode graphs' capture made."""
    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    forget_compiled_kernels()
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", quantization=quantization, max_model_len=1024,
              max_num_batched_tokens=1024, max_num_seqs=8, gpu_memory_fraction=0.2, enable_prefix_caching=False)
    runner = llm.engine.runner
    pg = runner.prompt_graphs
    assert pg is not None and sorted(pg.graphs) == pg.buckets and pg.buckets[-1] == 1024
    assert runner.graphs.pool is not None and pg.pool == runner.graphs.pool == runner.mixed_graphs.pool
    compiled = record_compiles(monkeypatch)
    # steps: 1 x 5 tokens, 64, 65 + 3, 1000 + a 24-token chunk (samples nothing), then its last 6 beside a
    # decode (eager), 4 prompts of 650 in all, 5 prompts (eager), 1001, 2
    lengths = [[5], [64], [65, 3], [1000, 30], [300, 200, 100, 50], [9, 8, 7, 6, 5], [1001], [2]]
    groups = [[list(range(1000 + 9 * i + j, 1000 + 9 * i + j + n)) for j, n in enumerate(g)]
              for i, g in enumerate(lengths)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run():
        outs = [o.outputs[0] for g in groups for o in llm.generate(g, params)]
        return [o.token_ids for o in outs], torch.tensor([[e.logprob for e in o.logprobs] for o in outs])

    graphed = run()
    assert pg.replays == 7, pg.replays
    assert compiled == [], compiled
    runner.prompt_graphs = None
    eager = run()
    assert pg.replays == 7
    assert graphed[0] == eager[0]
    assert (graphed[1] - eager[1]).abs().max().item() <= 0.01


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_mixed_graphs_match_the_eager_path(tiny_models, monkeypatch, quantization):
    """Steps of a few decodes beside up to 4 prompt chunks of up to 1,024 tokens replay a captured graph
    (worker/executor/graphs/mixed.py), padded to their decode size and token bucket. Four sequences at a time,
    ending at different lengths, so each waiting prompt (7 to 500 tokens) joins the others' decodes as a
    slot frees. With logprobs (steps in turn) and without (overlapped steps, whose decodes read their last
    token from the device into the padded rows) they give the eager path's tokens and logprobs, and
    nothing compiles after start-up."""
    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    forget_compiled_kernels()
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", quantization=quantization, max_model_len=1024,
              max_num_batched_tokens=1024, max_num_seqs=4, gpu_memory_fraction=0.2, enable_prefix_caching=False)
    runner = llm.engine.runner
    mg = runner.mixed_graphs
    assert mg is not None and sorted(mg.graphs) == mg.keys and mg.keys[-1] == (4, 1024)
    compiled = record_compiles(monkeypatch)
    lengths = [40, 20, 50, 30, 7, 25, 60, 300, 12, 64, 65, 500]
    prompts = [list(range(1000 + 37 * i, 1000 + 37 * i + n)) for i, n in enumerate(lengths)]

    def run(logprobs):
        params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True, logprobs=logprobs)
                  for i in range(len(prompts))]
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], [[e.logprob for e in o.logprobs or []] for o in outs]

    graphed = [run(0), run(None)]
    replays = mg.replays
    assert replays >= 12, replays  # 8 prompts join decodes in each run
    assert compiled == [], compiled
    runner.mixed_graphs = None
    eager = [run(0), run(None)]
    assert mg.replays == replays
    assert all(graphed[0][1]) and not any(graphed[1][1])  # logprobs from the first run only
    for (g_tokens, g_logprobs), (e_tokens, e_logprobs) in zip(graphed, eager, strict=True):
        assert g_tokens == e_tokens
        pairs = [(a, b) for ga, ea in zip(g_logprobs, e_logprobs, strict=True) for a, b in zip(ga, ea, strict=True)]
        assert max((abs(a - b) for a, b in pairs), default=0.0) <= 0.01


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("fp8", "auto"), (None, "fp8")])
def test_no_kernel_compiles_after_start_up(tiny_models, monkeypatch, quantization, kv_cache_dtype):
    """Triton compiles a kernel variant for each class of int divisibility and pointer alignment it meets,
    and one compiled mid-run stalls every running request (100-155 ms each in an H200 serving probe: the
    argmax per batch size, RoPE at odd token counts). After start-up, odd and even token counts, prompt
    chunks mixed into decodes, many batch sizes, and greedy, sampled, penalised and forked rows must
    compile nothing."""
    from triton.runtime.jit import JITFunction

    if (quantization or kv_cache_dtype != "auto") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    if not hasattr(JITFunction, "_do_compile"):
        pytest.skip("this Triton compiles elsewhere")
    forget_compiled_kernels()  # the engine's start-up alone must make every variant the workload needs
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", quantization=quantization, max_model_len=512,
              max_num_batched_tokens=48, max_num_seqs=16, gpu_memory_fraction=0.2, kv_cache_dtype=kv_cache_dtype)
    compiled = record_compiles(monkeypatch)
    lengths = (7, 20, 33, 150, 301, 2, 64, 9, 1, 47, 5, 128)
    prompts = [list(range(1000 + i, 1000 + i + n)) for i, n in enumerate(lengths)]
    kinds = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=1.0, top_k=5, n=2, max_tokens=7, ignore_eos=True)]
    outs = llm.generate(prompts, [kinds[i % 4] for i in range(len(prompts))])
    outs += llm.generate(prompts[:5], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [len(c.token_ids) for c in outs[3].outputs] == [7, 7] and len(outs[-1].outputs[0].token_ids) == 40
    steps = llm.engine.recent_steps
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    assert len({s.num_seqs for s in steps if not s.num_prefill_tokens}) >= 4  # several decode batch sizes
    assert compiled == [], f"compiled after start-up: {compiled}"


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_compile_workers_fill_the_cache(tiny_models, tmp_path, monkeypatch, capsys, quantization):
    """A cold start (empty Triton cache, nothing compiled in this process) with compile workers: they compile
    every variant the engine's start-up needs, so this process compiles none; the next start with the same
    settings finds the marker and starts no workers, and serves the same tokens."""
    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs Ada or Hopper")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    forget_compiled_kernels()
    settings = dict(dtype="bfloat16", quantization=quantization, max_model_len=512, max_num_batched_tokens=48,
                    max_num_seqs=16, gpu_memory_fraction=0.2)
    llm = LLM(str(tiny_models["llama"]), compile_workers=3, **settings)
    out = capsys.readouterr().out
    assert "3 compile workers done" in out and "compile worker failed" not in out, out
    assert "this process compiled 0 kernels the workers had not" in out, out
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    del llm
    forget_compiled_kernels()
    again = LLM(str(tiny_models["llama"]), compile_workers=3, **settings)
    out = capsys.readouterr().out  # none started (the engine's phase line still says "compile workers 0.0s")
    started = r"compile workers? (done|failed)|slowest compile worker|could not start a compile worker"
    assert not re.search(started, out), out
    assert [o.outputs[0].token_ids for o in again.generate(PROMPTS, params)] == first
