"""LoRA adapters: PEFT's own folders, against PEFT's own forward; adapters and the base model in one batch;
prefix-cache isolation; loading and unloading while the engine runs; clear errors."""

import pytest
import torch

from engine_models import hf_greedy, make_adapter
from pagefleet.worker import LLM, SamplingParams

peft = pytest.importorskip("peft")
# A fixed KV size, not a share of the card: on a GPU several engines of one test (and the server a test
# starts) must fit beside each other, and each would otherwise take gpu_memory_fraction of the whole card.
BLOCKS = 200
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(200, 231)), list(range(500, 509)), list(range(40, 97))]


def peft_greedy(base, adapter, prompts, max_new_tokens=12):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base_model, str(adapter)).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    base = tiny_models["llama"]
    return {"a": make_adapter(base, root / "a", 1),
            "b": make_adapter(base, root / "b", 2, rank=8, targets=("q_proj", "v_proj", "down_proj")),
            "qwen2": make_adapter(tiny_models["qwen2"], root / "qwen2", 3),
            "qwen3": make_adapter(tiny_models["qwen3"], root / "qwen3", 4)}


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,adapter", [("llama", "a"), ("llama", "b"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_adapter_outputs_match_peft(tiny_models, adapters, arch, adapter):
    # On the CPU even where there is a GPU: token-for-token equality with PEFT's fp32 forward needs fp32
    # arithmetic throughout, and on a GPU our kernels' fp32 dots run on tensor cores in TF32 (on the
    # H200 the first 12 greedy tokens of this random tiny model then differed).
    llm = LLM(str(tiny_models[arch]), max_model_len=256, enable_lora=True, max_lora_rank=8, device="cpu")
    llm.load_lora("x", str(adapters[adapter]))
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_name="x"))
    assert ours == peft_greedy(tiny_models[arch], adapters[adapter], PROMPTS)
    assert ours != hf_greedy(tiny_models[arch], PROMPTS, 12), "the adapter changed nothing: the test proves nothing"
    assert tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy(tiny_models[arch], PROMPTS, 12)  # the base stays the base


def test_base_and_two_adapters_share_every_step(tiny_models, adapters):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
              max_lora_rank=8, max_num_batched_tokens=24)
    llm.load_lora("a", str(adapters["a"]))
    llm.load_lora("b", str(adapters["b"]))
    solo = {name: tokens(llm.generate(PROMPTS, GREEDY, lora_name=name)) for name in ("a", "b", None)}
    engine = llm.engine
    engine.emit_partial = False
    mixes, finals = 0, {}
    for i, ids in enumerate(PROMPTS):
        for name in ("a", None, "b"):
            engine.add_request(f"{name}-{i}", ids, GREEDY, name)
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out.outputs[0].token_ids
        mixes += engine.recent_steps[-1].num_seqs == 9
    assert mixes, "the nine requests never ran in one step"
    for name in ("a", "b", None):
        assert [finals[f"{name}-{i}"] for i in range(3)] == solo[name]


def test_adapter_samples_share_the_prompt_and_survive_preemption(tiny_models, adapters):
    """n = 3 samples of an adapter request share its prompt blocks (copy-on-write) and each equals a single
    request with its seed; a KV budget too small for all of them preempts and recomputes, same outputs."""
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)
    roomy = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
                max_lora_rank=8)
    roomy.load_lora("a", str(adapters["a"]))
    fan_out = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True, n=3)
    (fanned,) = roomy.generate([PROMPTS[2]], fan_out, lora_name="a")
    singles = [roomy.generate([PROMPTS[2]], SamplingParams(temperature=0.9, seed=7 + i, max_tokens=20, ignore_eos=True),
                              lora_name="a")[0]
               for i in range(3)]
    assert [o.token_ids for o in fanned.outputs] == [s.outputs[0].token_ids for s in singles]
    tight = LLM(str(tiny_models["llama"]), max_model_len=96, enable_lora=True, max_lora_rank=8,
                num_gpu_blocks_override=9)
    tight.load_lora("a", str(adapters["a"]))
    outs = tight.generate([PROMPTS[2]] * 3, [sampled] * 3, lora_name="a")
    assert tight.engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    want = roomy.generate([PROMPTS[2]], sampled, lora_name="a")[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == want for o in outs)


def test_prefix_cache_keeps_adapters_apart(tiny_models, adapters):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
              max_lora_rank=8)
    llm.load_lora("a", str(adapters["a"]))
    prompt = list(range(300, 340))  # two full blocks of 16
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    # the base model's K/V are not the adapter's
    assert llm.generate([prompt], GREEDY, lora_name="a")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, lora_name="a")[0].num_cached_tokens == 32
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 32


def test_hot_swap_and_clear_errors(tiny_models, adapters, tmp_path):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
              max_lora_rank=4, max_loras=1)
    llm.load_lora("a", str(adapters["a"]))
    with_a = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_name="a"))
    with pytest.raises(ValueError, match="all 1 LoRA slots are in use"):
        llm.load_lora("again", str(adapters["a"]))
    llm.engine.add_request("busy", PROMPTS[0], GREEDY, "a")
    with pytest.raises(ValueError, match="in use by 1 request"):
        llm.unload_lora("a")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.unload_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate(PROMPTS[:1], GREEDY, lora_name="a")
    with pytest.raises(ValueError, match="rank 8 is outside 1..4"):
        llm.load_lora("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        llm.load_lora("nothing", str(tmp_path))
    llm.load_lora("a2", str(adapters["a"]))  # the freed slot takes a new adapter, no restart
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, lora_name="a2")) == with_a
    import shutil

    from safetensors.torch import load_file, save_file

    wrong = tmp_path / "wrong-model"  # an adapter made for a model of another width
    shutil.copytree(adapters["a"], wrong)
    weights = load_file(str(wrong / "adapter_model.safetensors"))
    save_file({k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in weights.items()},
              str(wrong / "adapter_model.safetensors"))
    llm.unload_lora("a2")
    with pytest.raises(ValueError, match="was the adapter made for another model"):
        llm.load_lora("wrong", str(wrong))
    plain = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.load_lora("a", str(adapters["a"]))


@pytest.mark.slow
def test_server_serves_loads_and_unloads_adapters(tiny_models, adapters, tmp_path):
    import httpx
    import openai

    from servers import AUTH, Server  # tests/ is on sys.path (tests/conftest.py)

    offline = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
                  max_lora_rank=8)
    offline.load_lora("a", str(adapters["a"]))
    offline.load_lora("b", str(adapters["b"]))
    want = {name: offline.generate(PROMPTS[:1], GREEDY, lora_name=name)[0].outputs[0].text for name in ("a", "b", None)}
    server = Server(tmp_path / "server.log", "--model", str(tiny_models["llama"]), "--max-model-len", "256",
                    "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}")
    try:
        client = server.client()

        def complete(model):
            return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"smol", "a"} and models["a"].model_extra["parent"] == "smol"
        assert complete("a") == want["a"] and complete("smol") == want[None]
        # hot swap under load: b is loaded, used and unloaded while a request on a streams
        long_greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        long_a = offline.generate(PROMPTS[:1], long_greedy, lora_name="a")[0].outputs[0].text
        stream = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=120, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        streamed = next(chunks).choices[0].text
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])},
                       headers=AUTH)
        assert r.status_code == 200, r.text
        assert complete("b") == want["b"]
        # the cheap probe names each loaded adapter with its folder (the gateway and the operator read it)
        assert server.load()["lora_adapters"] == {"a": str(adapters["a"]), "b": str(adapters["b"])}
        streamed += "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == long_a  # the stream on a went on untouched through b's load and use
        bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)},
                         headers=AUTH)
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.json()["error"]["message"]
        no_key = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "x"})
        assert no_key.status_code == 401
        unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=AUTH)
        assert unloaded.status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("b")
        assert server.load()["lora_adapters"] == {"a": str(adapters["a"])}
        gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=AUTH)
        assert gone.status_code == 404 and set(gone.json()["error"]) == {"message", "type", "param", "code"}
        assert complete("a") == want["a"]  # the other adapter never moved
    finally:
        server.stop()


def test_metrics_name_the_running_and_waiting_adapters_as_vllm_does(tiny_models, adapters):
    from prometheus_client.parser import text_string_to_metric_families

    from pagefleet.worker.entrypoints.metrics import ServerMetrics

    llm = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS, enable_lora=True,
              max_lora_rank=8, max_num_seqs=1, max_loras=3)
    llm.load_lora("a", str(adapters["a"]))
    llm.load_lora("b", str(adapters["b"]))
    engine = llm.engine
    engine.add_request("1", PROMPTS[0], GREEDY, "a")
    engine.add_request("2", PROMPTS[1], GREEDY, "b")
    engine.step()  # one sequence at a time: a runs, b waits
    text = ServerMetrics("tiny", engine.stats).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "3", "running_lora_adapters": "a", "waiting_lora_adapters": "b"}
    plain = LLM(str(tiny_models["llama"]), max_model_len=256, num_gpu_blocks_override=BLOCKS)
    assert "vllm:lora_requests_info" not in ServerMetrics("tiny", plain.engine.stats).render().decode()


@pytest.mark.parametrize("flags", [["--lora-modules", "a=/x"], ["--enable-lora", "--lora-modules", "no-equals-sign"],
                                   ["--enable-lora", "--lora-modules", "=/x"]])
def test_serve_refuses_bad_lora_flags_before_loading_anything(tiny_models, tmp_path, flags):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pagefleet", "serve", "--model", str(tiny_models["llama"]), *flags],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert "--lora-modules takes NAME=PATH pairs and needs --enable-lora" in result.stdout
