"""Weight updates in place (engine/weight_updates.py, models/loader.apply_weights): after an update from a
checkpoint folder, in-process tensors, tensors of a second process (shared-memory handles) or a second process's
gloo broadcast, the engine holds exactly the weights of a fresh engine loaded with the new checkpoint, with the
decoder norms folded and with FP8 linears where those apply, and its greedy outputs equal that engine's token
for token. A partial update, the version counter, the prefix cache dropped, and refusals that name the
offending tensors and leave the old weights serving.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.models.layers.fp8 import quantize_linears_fp8
from ports import free_port

PROMPTS = [[5, 9, 200, 7], list(range(100, 140)), [42] * 20]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def perturbed(src, dst, seed: int, only=None):
    """A copy of checkpoint folder src whose tensors (those `only` accepts) are moved by seeded noise."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if only is None or only(name):
            tensors[name] = t + 0.3 * t.float().std().clamp(min=0.1) * torch.randn(t.shape, generator=g)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def mixed(src, dst, tensors: dict[str, torch.Tensor]):
    """A copy of checkpoint folder src with these tensors in place of its own."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    all_tensors = load_file(dst / "model.safetensors")
    all_tensors.update(tensors)
    save_file(all_tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def engine(path, fold=False, fp8=False) -> LLM:
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=32, device="cpu")
    model = llm.engine.runner.model
    if fold:  # what bring-up does on the GPU (bf16 / fp16 with CUDA graphs), in fp32 here
        model.fold_norms()
    if fp8:
        quantize_linears_fp8(model)
    return llm


def greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def assert_same_weights(a: LLM, b: LLM) -> None:
    pa, pb = dict(a.engine.runner.model.named_parameters()), dict(b.engine.runner.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        x, y = pa[name].data, pb[name].data
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), name


def state_of(llm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


def addresses(llm) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in llm.engine.runner.model.named_parameters()}


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-weights")
    return {arch: (tiny_models[arch], perturbed(tiny_models[arch], root / f"{arch}-new", seed=1))
            for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_update_from_disk_equals_a_fresh_engine_with_folded_norms(checkpoints, arch):
    old, new = checkpoints[arch]
    llm = engine(old, fold=True)
    before, ptrs = greedy(llm), addresses(llm)
    assert llm.weight_version == 0
    assert llm.update_weights_from_disk(str(new)) == 1 and llm.weight_version == 1
    fresh = engine(new, fold=True)
    assert_same_weights(llm, fresh)
    assert addresses(llm) == ptrs  # copied into the same storage: captured CUDA graphs stay valid
    after = greedy(llm)
    assert after == greedy(fresh) and after != before
    assert greedy(llm)[0] == after[0]  # and it keeps serving them


def test_update_from_in_process_tensors_unfolded(checkpoints):
    from safetensors.torch import load_file

    old, new = checkpoints["llama"]
    llm = engine(old)
    tensors = load_file(new / "model.safetensors")
    assert llm.update_weights_from_tensor(tensors) == 1  # a dict
    fresh = engine(new)
    assert_same_weights(llm, fresh)
    assert greedy(llm) == greedy(fresh)
    assert llm.update_weights_from_tensor(list(tensors.items())) == 2  # pairs; the same weights again
    assert_same_weights(llm, fresh)


def test_fp8_linears_are_requantised_in_place(checkpoints, tmp_path):
    from safetensors.torch import load_file

    old, new = checkpoints["llama"]
    llm = engine(old, fold=True, fp8=True)
    ptrs = addresses(llm)
    llm.update_weights_from_disk(str(new))
    fresh = engine(new, fold=True, fp8=True)
    assert_same_weights(llm, fresh)  # e4m3 bytes and per-row scales alike
    assert addresses(llm) == ptrs
    assert greedy(llm) == greedy(fresh)
    # one shard of a packed linear: its rows (and their scales) requantised, the others untouched
    q = "model.layers.1.self_attn.q_proj.weight"
    t = load_file(old / "model.safetensors")[q]
    llm.update_weights_from_tensor({q: t})
    half = engine(mixed(new, tmp_path / "q-old", {q: t}), fold=True, fp8=True)
    assert_same_weights(llm, half)


def test_partial_update_with_folded_norms(checkpoints, tmp_path):
    """Some linears with their norm, one linear's shard alone, and a norm alone: the linear it is folded into
    is rescaled by new / old norm, one rounding away from a fresh fold."""
    from safetensors.torch import load_file

    old, new = checkpoints["qwen3"]
    exact = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.self_attn.k_norm.weight", "lm_head.weight"}
    norm_alone = "model.layers.1.post_attention_layernorm.weight"
    chosen = exact | {norm_alone}
    new_tensors = load_file(new / "model.safetensors")
    target = mixed(old, tmp_path / "partial", {n: new_tensors[n] for n in chosen})

    llm = engine(old, fold=True)
    untouched = state_of(llm)
    llm.update_weights_from_tensor({n: new_tensors[n] for n in chosen})
    fresh = engine(target, fold=True)
    got, want = state_of(llm), state_of(fresh)
    c = llm.engine.model_config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    # rows that came new are exact; the rows their norm changed under (v of layer 0, gate of layer 1) rescaled
    rescaled = {"model.layers.0.self_attn.qkv_proj.weight": slice(q + kv, q + 2 * kv),
                "model.layers.1.mlp.gate_up_proj.weight": slice(0, inter)}
    for name in want:
        if name in rescaled:
            rows = rescaled[name]
            keep = torch.ones(want[name].shape[0], dtype=torch.bool)
            keep[rows] = False
            assert torch.equal(got[name][keep], want[name][keep]), name
            assert torch.allclose(got[name][rows], want[name][rows], rtol=1e-6, atol=1e-7), name
            assert not torch.equal(got[name][rows], untouched[name][rows])
        else:
            assert torch.equal(got[name], want[name]), name
    unchanged = "model.layers.1.self_attn.qkv_proj.weight"
    assert torch.equal(got[unchanged], untouched[unchanged])
    assert greedy(llm) == greedy(fresh)


def test_mismatched_names_and_shapes_are_refused_and_the_old_weights_serve(checkpoints):
    from safetensors.torch import load_file

    old, new = checkpoints["llama"]
    llm = engine(old, fold=True)
    before, weights = greedy(llm), state_of(llm)
    tensors = load_file(new / "model.safetensors")
    tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(3, 64)
    tensors["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(ValueError) as e:
        llm.update_weights_from_tensor(tensors)
    assert "model.layers.0.self_attn.v_proj.weight" in str(e.value) and "(3, 64)" in str(e.value)
    assert "model.layers.9.mlp.gate_proj.weight" in str(e.value)
    assert llm.weight_version == 0
    assert all(torch.equal(weights[n], p) for n, p in state_of(llm).items())
    assert greedy(llm) == before
    with pytest.raises(ValueError, match="not a folder"):
        llm.update_weights_from_disk(str(new / "config.json"))
    with pytest.raises(ValueError, match="not a serialized tensor list"):
        llm.update_weights_from_tensor("not base64 at all")


def test_an_update_between_the_tokens_of_running_requests_is_refused(checkpoints):
    old, new = checkpoints["llama"]
    llm = engine(old)
    llm.engine.add_request("r", PROMPTS[0], PARAMS)
    llm.engine.step()
    with pytest.raises(ValueError, match="running.*pause"):
        llm.update_weights_from_disk(str(new))
    assert llm.weight_version == 0


def test_the_prefix_cache_is_dropped_by_an_update(checkpoints):
    old, new = checkpoints["llama"]
    llm = engine(old)
    prompt = list(range(300, 340))  # two full blocks and more

    def cached():
        return llm.generate([prompt], PARAMS)[0].num_cached_tokens

    cached()
    assert cached() > 0
    llm.update_weights_from_disk(str(new))
    assert cached() == 0  # computed again with the new weights
    assert cached() > 0


def _run_trainer(script: str, *args):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


IPC_TRAINER = """
    import sys
    from safetensors.torch import load_file
    from pagefleet.worker.executor.weight_transfer import serialize_named_tensors

    tensors = load_file(sys.argv[1])  # the trainer's own tensors; only handles cross over
    print(serialize_named_tensors(tensors), flush=True)
    sys.stdin.readline()  # kept alive until the engine has copied them
"""


def test_update_from_a_second_process_through_shared_memory_handles(checkpoints):
    old, new = checkpoints["qwen3"]
    llm = engine(old, fold=True)
    trainer = _run_trainer(IPC_TRAINER, new / "model.safetensors")
    try:
        handles = trainer.stdout.readline().strip()
        assert handles, trainer.stderr.read()
        assert len(handles) < 100_000  # handles, not the 12 MB of weights
        assert llm.update_weights_from_tensor(handles) == 1
    finally:  # not communicate(): the trainer's shared-memory manager keeps its pipes open while we map them
        trainer.stdin.write("done\n")
        trainer.stdin.close()
        trainer.wait(timeout=60)
    fresh = engine(new, fold=True)
    assert_same_weights(llm, fresh)
    assert greedy(llm) == greedy(fresh)


BROADCAST_TRAINER = """
    import json, sys
    from safetensors.torch import load_file
    from pagefleet.worker.executor.weight_transfer import WeightBroadcaster

    port, path, shrink = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    tensors = load_file(path)
    if shrink:  # a trainer whose model does not match the engine's
        tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:32]
    print(json.dumps(WeightBroadcaster.metadata(tensors)), flush=True)
    trainer = WeightBroadcaster("127.0.0.1", port, world_size=2, bucket_bytes=1 << 20)  # several buckets
    try:
        trainer.broadcast(tensors)
        print("sent", flush=True)
    except ValueError as e:
        print("refused:", e, flush=True)
"""


def test_update_from_a_trainers_gloo_broadcast(checkpoints):
    import json

    old, new = checkpoints["llama"]
    llm = engine(old, fold=True)
    port = free_port()
    trainer = _run_trainer(BROADCAST_TRAINER, port, new / "model.safetensors", 0)
    meta = json.loads(trainer.stdout.readline())
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
    assert llm.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"]) == 1
    out, err = trainer.communicate(timeout=60)
    assert out.strip() == "sent", err
    fresh = engine(new, fold=True)
    assert_same_weights(llm, fresh)
    assert greedy(llm) == greedy(fresh)


def test_a_mismatched_broadcast_is_refused_on_both_sides(checkpoints):
    import json

    old, new = checkpoints["llama"]
    llm = engine(old)
    before, weights = greedy(llm), state_of(llm)
    port = free_port()
    trainer = _run_trainer(BROADCAST_TRAINER, port, new / "model.safetensors", 1)
    meta = json.loads(trainer.stdout.readline())
    llm.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight \(shape \(32, 128\)"):
        llm.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"])
    out, err = trainer.communicate(timeout=60)
    assert out.startswith("refused:"), (out, err)
    assert llm.weight_version == 0
    assert all(torch.equal(weights[n], p) for n, p in state_of(llm).items())
    assert greedy(llm) == before
