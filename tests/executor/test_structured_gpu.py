"""A grammar's token mask on the device inside the sampling path: greedy and sampled rows keep to it (on CPU and
CUDA), the graphed decode path gives eager's tokens under it, and it adds no host sync to a step.

How the host syncs are checked (CUDA): the masked sampling step runs under torch.cuda.set_sync_debug_mode
("error"), which raises on any synchronizing CUDA call (a blocking copy to the host, .item(), nonzero, a
stream or device synchronize); and over whole engine steps, the calls that wait for the device from Python
(torch.cuda.synchronize, Event.synchronize, Tensor.item / tolist / cpu of a CUDA tensor) are counted per step
and compared with the same synchronous steps without a grammar: one wait per step (the step's tokens), both.
"""

import json

import jsonschema
import numpy as np
import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.sampling_params import StructuredOutputsParams as Structured
from pagefleet.worker.core.sequence import Sequence
from pagefleet.worker.executor.sampler import Sampler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
V = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "size": {"enum": ["small", "large"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "size", "n"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON:", "Give me a JSON object for a cat:", "A dog, as JSON:"]


def masked_sampler(device: str, rows: int, allowed_per_row: int, rng: np.random.Generator):
    """A sampler whose grammar hook gives every row a bitmask of `allowed_per_row` random tokens."""
    sampler = Sampler(torch.device(device), seed=0, eos_token_ids=[2], max_num_seqs=rows)
    allowed = [rng.choice(V, allowed_per_row, replace=False) for _ in range(rows)]
    words = np.zeros((rows, V // 32), dtype=np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids:
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    bitmask = words.view(np.int32)
    sampler.grammar_bitmask = lambda seqs: (np.arange(len(seqs), dtype=np.int32), bitmask[: len(seqs)])
    return sampler, allowed


def seqs_of(temperatures, output_len=0):
    out = []
    for i, t in enumerate(temperatures):
        s = Sequence(f"r{i}", 0, [1, 2, 3] + [4] * output_len, 3, SamplingParams(temperature=t, seed=i), i)
        out.append(s)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_sampled_rows_keep_to_the_mask(device):
    rng = np.random.default_rng(0)
    R = 8
    sampler, allowed = masked_sampler(device, R, 5, rng)
    logits = torch.randn(R, V, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32) * 4
    raw = logits.clone()
    seqs = seqs_of([0.0 if i % 2 else 1.0 for i in range(R)])
    tokens = sampler.sample_on_device(logits, seqs).tolist()
    for r, (t, ids) in enumerate(zip(tokens, allowed, strict=True)):
        assert t in ids
        if r % 2:  # greedy: the best allowed token of the raw logits
            assert t == ids[int(raw[r, torch.as_tensor(ids, device=device)].float().argmax())]
    unmasked = Sampler(torch.device(device), seed=0, eos_token_ids=[2], max_num_seqs=R)
    free = unmasked.sample_on_device(raw.clone(), seqs_of([0.0 if i % 2 else 1.0 for i in range(R)])).tolist()
    assert sum(f not in ids for f, ids in zip(free, allowed, strict=True)) > R // 2  # the mask did the work


@pytest.mark.parametrize("device", DEVICES)
def test_a_single_allowed_token_is_always_drawn(device):
    """One allowed id per row, 256 rows, 6 output positions: some draws hit the noise's u = 1.0 case (about 1 in
    341 rows at this vocabulary), whose -inf logits score NaN or +inf; the sampler keeps them inside the mask."""
    rng = np.random.default_rng(1)
    R = 256
    sampler, allowed = masked_sampler(device, R, 1, rng)
    for position in range(6):
        logits = torch.randn(R, V, device=device)
        tokens = sampler.sample_on_device(logits, seqs_of([1.0] * R, position)).tolist()
        assert tokens == [int(ids[0]) for ids in allowed]


@needs_cuda
def test_masked_sampling_step_makes_no_host_sync():
    rng = np.random.default_rng(2)
    R = 16
    sampler, allowed = masked_sampler("cuda", R, 50, rng)
    for temperatures in ([0.0] * R, [1.0] * R, [0.0, 1.0] * (R // 2)):
        seqs = seqs_of(temperatures)
        logits = torch.randn(R, V, device="cuda", dtype=torch.bfloat16)
        sampler.sample_on_device(logits.clone(), seqs)  # the first call allocates (pinned buffers, kernels)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sampler.sample_on_device(logits, seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(t in ids for t, ids in zip(tokens.tolist(), allowed, strict=True))


def count_host_waits(monkeypatch):
    """Calls that make the host wait for the device, counted."""
    counts = {"n": 0}

    def counted(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.cuda, "synchronize", counted(torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted(torch.cuda.Event.synchronize))
    for name in ("item", "tolist", "cpu"):
        real = getattr(torch.Tensor, name)

        def on_cuda(self, *args, _real=real, **kwargs):
            if self.is_cuda:
                counts["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, on_cuda)
    return counts


def run_steps(llm, params, counts):
    """Generate PROMPTS step by step: (outputs, host waits per step that ran a forward)."""
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), llm.encode(p), params)
    finals, per_step = {}, []
    while engine.has_unfinished_requests():
        before, steps = counts["n"], engine.steps_total
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if engine.steps_total > steps:
            per_step.append(counts["n"] - before)
    return [finals[str(i)] for i in range(len(PROMPTS))], per_step


@needs_cuda
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graphed_decode_with_a_grammar_matches_eager_and_syncs_as_today(smollm2_path, monkeypatch, async_scheduling):
    """Synchronous steps and overlapped ones (a grammar step reads the previous step's tokens inside its launch,
    in place of the read after it) wait on the device once per step, as the same steps without a grammar do."""
    structured = Structured(json=SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured=structured)
    graphed = LLM(str(smollm2_path), max_model_len=512, gpu_memory_fraction=0.3, async_scheduling=async_scheduling)
    assert graphed.engine.runner.graphs is not None
    replays = []
    real_replay = graphed.engine.runner.cuda_graphs.replay

    def replay(step, feed):
        logits = real_replay(step, feed)
        replays.append(logits is not None)
        return logits

    graphed.engine.runner.cuda_graphs.replay = replay
    counts = count_host_waits(monkeypatch)
    plain, plain_waits = run_steps(graphed, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), counts)
    constrained, waits = run_steps(graphed, params, counts)
    assert sum(replays) > 10, "the decode steps were meant to replay CUDA graphs"
    assert 1 <= max(plain_waits) and max(waits) <= max(plain_waits), (waits, plain_waits)  # a step's token read
    monkeypatch.undo()
    del graphed
    torch.cuda.empty_cache()
    eager = LLM(str(smollm2_path), max_model_len=512, gpu_memory_fraction=0.3, enforce_eager=True,
                async_scheduling=False)
    expected = eager.generate(PROMPTS, params)
    for got, want in zip(constrained, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.outputs[0].text), SCHEMA)
    assert plain  # the unconstrained run finished too


@needs_cuda
def test_jump_forward_chunks_replay_mixed_graphs(tiny_models, tmp_path):
    """Jump-forward (--structured-outputs-jump-forward) at 12 sequences: each step carries the forced chunks of
    several of them beside the others' decodes, up to the mixed graphs' 16 (the scheduler runs the rest a token
    at a time); such steps replay mixed graphs, more chunks than a prompt graph holds among them, and give the
    tokens of the same engine with its mixed graphs off (its decode graphs stay: an eager engine rounds bf16
    differently in its decode steps). The tiny Llama spells JSON one character a token (bench serve's
    --json-chars tokenizer)."""
    import shutil

    from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer
    from pagefleet.worker.executor.graphs.mixed import MAX_CHUNKS
    from pagefleet.worker.executor.graphs.prompt import MAX_SEQS

    model = shutil.copytree(tiny_models["llama"], tmp_path / "llama-json")
    write_word_tokenizer(str(model), json_chars=True)
    prompts = [list(range(100 + 9 * i, 130 + 9 * i)) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=96, structured=Structured(json=SCHEMA))
    llm = LLM(str(model), dtype="bfloat16", max_model_len=512, gpu_memory_fraction=0.2, max_num_seqs=16,
              structured_outputs_jump_forward=True)
    runner = llm.engine.runner
    mg = runner.mixed_graphs
    assert mg is not None and mg.max_chunks == MAX_CHUNKS and llm.engine.scheduler.max_chunks == MAX_CHUNKS
    chunks = []
    real_stage = mg.stage

    def stage(step, feed=None):
        chunks.append(step.num_seqs - step.num_decodes)
        return real_stage(step, feed)

    mg.stage = stage
    jumped = llm.engine.jump_forward_tokens_total
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.jump_forward_tokens_total > jumped and max(chunks) > MAX_SEQS, chunks
    runner.mixed_graphs = None
    want = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
