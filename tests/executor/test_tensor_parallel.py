"""Tensor parallelism on CPU: two gloo ranks (rank 0 in the engine's process, rank 1 a worker process) give the
greedy tokens of one rank on tiny random Llama, Qwen2, Qwen3 and Qwen3.5 (hybrid) checkpoints, with 16-token
prefill chunks, overlapped steps, prefix-cache hits and forced preemption; weight updates reach every rank; a
rank that dies fails the engine at once, and the workers end with rank 0. Refusals name the model's sizes."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_models import tiny_model, tiny_qwen3_5
from pagefleet.worker import LLM, SamplingParams

MAX_NEW = 10
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {a: tiny_qwen3_5(root / a) if a == "qwen3_5" else tiny_model(a, root / a) for a in ARCHS}


def prompts() -> list[list[int]]:
    """Prompts of 1 to 90 tokens (ids below every tiny vocabulary); two share 64 tokens, one repeats."""
    shared = [(7 * i + 3) % 500 + 3 for i in range(64)]
    out = [[(13 * i + 5 * n) % 500 + 3 for i in range(n)] for n in (3, 17, 90, 1, 40)]
    return out + [shared + [11, 12, 13], shared + [21] * 20, out[2]]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def engine(path, tp: int, **kw) -> LLM:
    # 10 blocks of 16 tokens: every prompt fits, all of them at once do not (preemption)
    args = dict(device="cpu", max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=10)
    return LLM(str(path), tensor_parallel_size=tp, **(args | kw))


def tokens(llm: LLM, ps=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps or prompts(), greedy())]


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_the_tokens_of_one(checkpoints, arch):
    path = checkpoints[arch]
    want = tokens(engine(path, 1))
    llm = engine(path, 2)
    try:
        assert llm.engine.runner.kv.data.shape[4] == 1  # each rank holds one of the two KV heads
        assert tokens(llm) == want
        again = llm.generate(prompts(), greedy())  # the same prompts once more: prefix hits on both ranks
        assert [o.outputs[0].token_ids for o in again] == want
        stats = llm.engine.stats()
        assert stats.num_preemptions_total > 0, "the KV budget was meant to force preemption"
        assert stats.prefix_cache_hits_total > 0
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats.recent_steps), "no mixed step"
        assert max(s.num_prefill_tokens for s in stats.recent_steps) <= 16
    finally:
        llm.shutdown()


def test_seeded_samples_of_one_request_equal_their_n1_twins(checkpoints):
    llm = engine(checkpoints["qwen3"], 2, num_gpu_blocks_override=64)
    try:
        prompt = prompts()[1]
        params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=7, n=4)
        fours = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
        ones = [llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                      seed=7 + i))[0].outputs[0].token_ids for i in range(4)]
        assert fours == ones and len({tuple(f) for f in fours}) > 1
    finally:
        llm.shutdown()


def test_two_ranks_with_an_fp8_kv_cache_give_the_tokens_of_one(checkpoints):
    """--kv-cache-dtype fp8: each rank keeps its KV heads' share in e4m3, as one rank keeps all of them."""
    path = checkpoints["llama"]
    want = tokens(engine(path, 1, kv_cache_dtype="fp8"))
    llm = engine(path, 2, kv_cache_dtype="fp8")
    try:
        assert llm.engine.runner.kv.data.dtype == torch.float8_e4m3fn
        assert tokens(llm) == want
    finally:
        llm.shutdown()


def test_prompt_logprobs_of_two_ranks_are_those_of_one(checkpoints):
    """Every rank scores the prompt (the vocabulary's shards are gathered), rank 0 reports it."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    ps = prompts()[:3]
    want = [o.prompt_logprobs for o in engine(checkpoints["llama"], 1).generate(ps, params)]
    llm = engine(checkpoints["llama"], 2)
    try:
        got = [o.prompt_logprobs for o in llm.generate(ps, params)]
    finally:
        llm.shutdown()
    for g, w, p in zip(got, want, ps, strict=True):
        assert len(g) == len(p) and g[0] is None
        assert [(e.token_id, [t for t, _ in e.top]) for e in g[1:]] == [(e.token_id, [t for t, _ in e.top])
                                                                         for e in w[1:]]
        assert [e.logprob for e in g[1:]] == pytest.approx([e.logprob for e in w[1:]], abs=1e-4)
        # deep in the tail a token within float noise of the prompt token may rank either side of it
        assert all(abs(a.rank - b.rank) <= max(1, b.rank // 1000) for a, b in zip(g[1:], w[1:], strict=True))


def test_lora_adapters_are_sharded_like_their_linears(checkpoints, tmp_path):
    """Every target (q/k/v, gate/up column-parallel; o_proj, down_proj row-parallel), from a folder and from
    tensors, beside requests of the base model in the same steps."""
    from safetensors.torch import load_file as read

    from engine_models import make_adapter

    base = checkpoints["llama"]
    one, two = make_adapter(base, tmp_path / "one", seed=1), make_adapter(base, tmp_path / "two", seed=2)
    ps = prompts()[:4]

    def run(llm):
        llm.load_lora("one", str(one))
        llm.load_lora_from_tensors("two", read(two / "adapter_model.safetensors"), {"r": 4, "lora_alpha": 8})
        outs = [tokens(llm, ps)]
        for name in ("one", "two"):
            outs.append([o.outputs[0].token_ids for o in llm.generate(ps, greedy(), lora_name=name)])
        llm.unload_lora("one")
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, greedy(), lora_name="two")])
        return outs

    want = run(engine(base, 1, enable_lora=True, num_gpu_blocks_override=64))
    assert want[1] != want[0] and want[2] != want[0] and want[3] == want[2]
    llm = engine(base, 2, enable_lora=True, num_gpu_blocks_override=64)
    try:
        assert run(llm) == want
    finally:
        llm.shutdown()


def scaled_copy(src: Path, dst: Path, factor: float) -> Path:
    """The checkpoint with every 2-D weight scaled: other weights, other tokens."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {n: (t * factor if t.dim() == 2 else t) for n, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_weight_updates_reach_every_rank(checkpoints, tmp_path):
    a = checkpoints["llama"]
    b = scaled_copy(a, tmp_path / "b", 1.3)
    ps = prompts()[:4]
    want_a, want_b = tokens(engine(a, 1), ps), tokens(engine(b, 1), ps)
    assert want_a != want_b
    llm = engine(a, 2)
    try:
        assert llm.update_weights_from_disk(str(b)) == 1
        assert tokens(llm, ps) == want_b
        assert llm.update_weights_from_tensor(load_file(a / "model.safetensors")) == 2
        assert tokens(llm, ps) == want_a
        with pytest.raises(ValueError, match="refused"):  # checked on rank 0 before any rank writes
            llm.update_weights_from_tensor({"model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)})
        assert tokens(llm, ps) == want_a
    finally:
        llm.shutdown()


TRAINER = """
import json, sys
from safetensors.torch import load_file
from pagefleet.worker.executor.weight_transfer import WeightBroadcaster

tensors = load_file(sys.argv[2])
print(json.dumps(WeightBroadcaster.metadata(tensors)), flush=True)
WeightBroadcaster("127.0.0.1", int(sys.argv[1]), world_size=2, bucket_bytes=1 << 20).broadcast(tensors)
print("sent", flush=True)
"""


def test_a_trainers_broadcast_reaches_every_rank(checkpoints, tmp_path):
    """The trainer's group holds rank 0 only; rank 0 passes each tensor on to its workers as it arrives."""
    import json

    from ports import free_port

    a = checkpoints["llama"]
    b = scaled_copy(a, tmp_path / "b", 0.8)
    want_b = tokens(engine(b, 1), prompts()[:4])
    llm = engine(a, 2)
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(b / "model.safetensors")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        meta = json.loads(trainer.stdout.readline())
        llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
        assert llm.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"]) == 1
        out, err = trainer.communicate(timeout=60)
        assert out.strip() == "sent", err
        assert tokens(llm, prompts()[:4]) == want_b
    finally:
        trainer.kill()
        llm.shutdown()


DEAD_RANK = """
import os, signal, sys, time
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.executor.tensor_parallel import RankFailure

llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=256)
worker = llm.engine.runner.procs[0]
long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
llm.generate([[1, 2, 3]], long)
os.kill(worker.pid, signal.SIGKILL)
worker.wait(10)
start = time.monotonic()
for prompts in ([[1, 2, 3]] * 4, [[4, 5]]):
    try:
        llm.generate(prompts, long)
        print("no error")
    except RankFailure as e:
        print("RankFailure:", e)
print(f"seconds {time.monotonic() - start:.1f}")
llm.shutdown()
"""


def test_a_dead_rank_fails_the_engine_at_once(checkpoints, tmp_path):
    """In a process of its own: a group with a dead peer is not left to the test session's exit."""
    out = subprocess.run([sys.executable, "-c", DEAD_RANK, str(checkpoints["llama"])], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    lines = out.stdout.splitlines()
    failures = [line for line in lines if line.startswith("RankFailure:")]
    assert len(failures) == 2, out.stdout + out.stderr  # the step in flight, and every call after it
    assert all(re.search(r"cannot continue: rank 1 \(pid \d+\) exited with -9", f) for f in failures), failures
    assert float(lines[-1].split()[-1]) < 30


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waits for a reaper, but runs nothing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_workers_end_with_rank_0(checkpoints, tmp_path):
    script = (f"import os, signal; from pagefleet.worker import LLM; "
              f"llm = LLM({str(checkpoints['llama'])!r}, device='cpu', tensor_parallel_size=2, "
              f"max_model_len=128, num_gpu_blocks_override=32); print(llm.engine.runner.procs[0].pid, flush=True); "
              f"os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"worker {pid} outlived its rank 0"


def test_sizes_that_do_not_split_are_refused_before_any_process(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8, got 3"):
        engine(checkpoints["llama"], 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 does not divide the model's 4 attention heads"):
        engine(checkpoints["llama"], 8)
    with pytest.raises(ValueError, match="sleep mode is not sharded yet"):
        engine(checkpoints["llama"], 2, enable_sleep_mode=True)
