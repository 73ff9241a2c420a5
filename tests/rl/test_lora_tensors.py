"""LoRA adapters from a trainer's tensors (LoRAManager.load_tensors, the one path a PEFT folder takes too):
offline, through the async engine and over HTTP (POST /load_lora_adapter_from_tensors with the string of
serialize_named_tensors), an adapter given as PEFT tensors and adapter_config fields fills its slot exactly as
the same adapter's folder does and gives the same greedy tokens; a tensor of a wrong name or shape, or a config
field that changes the maths, is refused with its name, and nothing is loaded.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from engine_models import make_adapter
from pagefleet.worker import LLM, SamplingParams
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.engine.async_engine import AsyncLLMEngine
from pagefleet.worker.executor.weight_transfer import serialize_named_tensors
from servers import AUTH, Server

pytest.importorskip("peft")
PROMPTS = [list(range(200, 231)), [5, 9, 200, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8, device="cpu")
Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tensors")
    return {"llama": make_adapter(tiny_models["llama"], root / "llama", 1),
            "qwen3": make_adapter(tiny_models["qwen3"], root / "qwen3", 2, rank=8,
                                  targets=("q_proj", "v_proj", "gate_proj", "down_proj"))}


def peft_tensors(folder) -> tuple[dict[str, torch.Tensor], dict]:
    """What a trainer holds: the adapter's tensors under their PEFT names and its adapter_config fields."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return load_file(str(folder / "adapter_model.safetensors")), config


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def slot_buffers(llm: LLM, name: str) -> list[torch.Tensor]:
    lora = llm.engine.runner.lora
    slot = lora.slot_of[name]
    return [t[slot] for layer in lora.layers for w in layer.values() for t in (w.a, w.b)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tensors_load_as_the_folder_does(tiny_models, adapters, arch):
    llm = LLM(str(tiny_models[arch]), **ENGINE_ARGS)
    llm.load_lora("folder", str(adapters[arch]))
    tensors, config = peft_tensors(adapters[arch])
    llm.load_lora_from_tensors("tensors", tensors, config)
    llm.load_lora_from_tensors("handles", serialize_named_tensors(tensors), config)  # a trainer's shared memory
    want = slot_buffers(llm, "folder")
    for name in ("tensors", "handles"):
        assert all(torch.equal(a, b) for a, b in zip(slot_buffers(llm, name), want, strict=True)), name
    base = tokens(llm.generate(PROMPTS, GREEDY))
    from_folder = tokens(llm.generate(PROMPTS, GREEDY, lora_name="folder"))
    assert from_folder != base, "the adapter changed nothing: the test proves nothing"
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_name="tensors")) == from_folder
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_name="handles")) == from_folder
    assert llm.engine.lora_paths()["tensors"] == "<tensors>"


def _changed(tensors, **replace):
    out = dict(tensors)
    for name, t in replace.items():
        if t is None:
            del out[name]
        else:
            out[name] = t
    return out


def test_bad_tensors_and_configs_are_refused_by_name(tiny_models, adapters):
    llm = LLM(str(tiny_models["llama"]), **ENGINE_ARGS)
    tensors, config = peft_tensors(adapters["llama"])
    q_b = Q_A.replace("lora_A", "lora_B")
    cases = [
        (_changed(tensors, **{Q_A: tensors[Q_A][:, :32]}), config, rf"{Q_A}.*shape \(4, 32\).*needs \(4, 64\)"),
        (_changed(tensors, **{q_b: tensors[q_b][:32]}), config, rf"{q_b}.*shape \(32, 4\).*needs \(64, 4\)"),
        (_changed(tensors, **{Q_A: tensors[Q_A][:2]}), config, rf"{Q_A}.*dimension 0 must be the rank r = 4"),
        (_changed(tensors, **{Q_A: tensors[Q_A][0]}), config, rf"{Q_A}.*2-D floating-point"),
        (_changed(tensors, **{q_b: None}), config, rf"{Q_A}' has no lora_B"),
        ({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, config,
         r"'base_model.model.lm_head.lora_A.weight': only the decoder layers"),
        ({**tensors, Q_A.replace("layers.1", "layers.7"): tensors[Q_A]}, config, r"layers.7.*names layer 7.*has 2"),
        ({**tensors, Q_A.replace("q_proj", "qkv"): tensors[Q_A]}, config, r"target 'qkv'"),
        ({k.replace("lora_A.weight", "lora_A.default.weight"): v for k, v in tensors.items()}, config,
         r"unsupported LoRA tensor .*lora_A.default.weight"),
        ({}, config, "holds no LoRA tensors"),
        (tensors, {**config, "use_dora": True}, "'use_dora' is not supported"),
        (tensors, {**config, "rank_pattern": {"q_proj": 2}}, "'rank_pattern' is not supported"),
        (tensors, {**config, "r": 16}, r"rank 16 is outside 1..8"),
        (tensors, {**config, "r": "4"}, "integer r"),
        (tensors, [("r", 4)], "must be a dict"),
        ({"x": "not a tensor"}, config, "torch.Tensor"),
    ]
    for bad_tensors, bad_config, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.load_lora_from_tensors("bad", bad_tensors, bad_config)
            pytest.fail(f"loaded; expected the error {message!r}")
        assert llm.engine.lora_names() == []
    with pytest.raises(ValueError, match="not a serialized tensor list"):
        llm.load_lora_from_tensors("bad", "not base64 at all", config)
    llm.load_lora_from_tensors("good", tensors, config)  # a refusal left no slot half written or taken
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora_from_tensors("good", tensors, config)
    plain = LLM(str(tiny_models["llama"]), max_model_len=128, num_gpu_blocks_override=16, device="cpu")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.load_lora_from_tensors("a", tensors, config)


async def test_async_engine_loads_tensors_between_steps(tiny_models, adapters):
    llm = LLM(str(tiny_models["llama"]), **ENGINE_ARGS)
    llm.load_lora("folder", str(adapters["llama"]))
    want = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_name="folder"))[0]
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_models["llama"]), **ENGINE_ARGS))
    try:
        await engine.load_lora_from_tensors("t", *peft_tensors(adapters["llama"]))
        assert engine.lora_names() == ["t"] and engine.load()["lora_adapters"] == {"t": "<tensors>"}
        outs = [out async for out in engine.generate(PROMPTS[0], GREEDY, "r", lora_name="t")]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
        with pytest.raises(ValueError, match=Q_A):
            tensors, config = peft_tensors(adapters["llama"])
            await engine.load_lora_from_tensors("bad", _changed(tensors, **{Q_A: tensors[Q_A][:, :8]}), config)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_load_lora_adapter_from_tensors_over_http(tiny_models, adapters, tmp_path):
    server = Server(tmp_path / "server.log", "--model", str(tiny_models["llama"]), "--max-model-len", "128",
                    "--enable-lora", "--max-lora-rank", "8", "--enable-rl-endpoints")
    try:
        tensors, config = peft_tensors(adapters["llama"])

        def post(path, body):
            return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)

        def greedy(model):
            r = post("/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                                         "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert post("/v1/load_lora_adapter", {"lora_name": "folder", "lora_path": str(adapters["llama"])}
                    ).status_code == 200
        # shared memory of this process, one serialization per call (opening one consumes its references)
        body = {"lora_name": "tensors", "config_dict": config, "serialized_tensors": serialize_named_tensors(tensors)}
        r = post("/load_lora_adapter_from_tensors", body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert greedy("tensors") == greedy("folder") != greedy("smol")
        assert httpx.get(server.url + "/load").json()["lora_adapters"]["tensors"] == "<tensors>"
        again = {**body, "lora_name": "again", "serialized_tensors": serialize_named_tensors(tensors)}
        assert post("/load_lora_adapter_from_tensor", again).status_code == 200

        bad_tensors = _changed(tensors, **{Q_A: tensors[Q_A][:, :32].contiguous()})
        bad = serialize_named_tensors(bad_tensors)
        r = post("/load_lora_adapter_from_tensors", {**body, "lora_name": "bad", "serialized_tensors": bad})
        assert r.status_code == 400 and Q_A in r.json()["error"]["message"], r.text
        gone = torch.randn(4, 64)  # handles whose shared memory is gone (the sender let go of it) open nothing
        dead = serialize_named_tensors({Q_A: gone})
        os.unlink("/dev/shm" + gone.untyped_storage()._share_filename_cpu_()[1].decode())
        r = post("/load_lora_adapter_from_tensors", {**body, "lora_name": "bad", "serialized_tensors": dead})
        assert r.status_code == 400 and "keep them alive" in r.json()["error"]["message"], r.text
        r = post("/load_lora_adapter_from_tensors", {**body, "lora_name": "bad", "load_format": "flattened_bucket"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_format", r.text
        r = post("/load_lora_adapter_from_tensors", {**body, "lora_name": "smol"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
        r = post("/load_lora_adapter_from_tensors", {"lora_name": "bad", "serialized_tensors": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "config_dict", r.text
        assert "bad" not in httpx.get(server.url + "/load").json()["lora_adapters"]
        r = httpx.post(server.url + "/load_lora_adapter_from_tensors", json=body)
        assert r.status_code == 401
    finally:
        server.stop()
