"""The operator's LoRA sync (operator/adapters.py) against a real worker process: loads, path changes,
unloads, a bad folder, an adapter busy with a stream, a worker that does not answer."""

import asyncio

import pytest

from pagefleet.operator import adapters as sync

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def peft_adapters(tiny_models, tmp_path_factory):
    from engine_models import make_adapter

    root = tmp_path_factory.mktemp("sync-loras")
    base = tiny_models["llama"]
    return {"a": str(make_adapter(base, root / "a", 1)), "b": str(make_adapter(base, root / "b", 2))}


@pytest.mark.slow
def test_sync_brings_a_running_worker_to_the_listed_adapters(tiny_models, peft_adapters, tmp_path):
    from servers import AUTH, Server

    server = Server(tmp_path / "server.log", "--model", str(tiny_models["llama"]), "--max-model-len", "256",
                    "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")

    def run(desired):
        (result,) = asyncio.run(sync.sync_workers([server.url], desired, headers=AUTH))
        return result

    a, b = peft_adapters["a"], peft_adapters["b"]
    try:
        assert server.load()["lora_adapters"] == {}
        first = run({"a": a, "b": b})
        assert first.in_sync and first.loaded == {"a": a, "b": b} == server.load()["lora_adapters"]
        assert sync.status_of({"a": a, "b": b}, [first]) == {"adapters": 2, "workersInSync": "1/1", "message": ""}
        # a name now points at another folder: unloaded and loaded again from there; b is dropped
        moved = run({"a": b})
        assert moved.in_sync and server.load()["lora_adapters"] == {"a": b}
        # a folder that is no adapter: the error names the adapter and the cause; the rest still syncs
        bad = run({"a": b, "c": str(tmp_path)})
        assert bad.loaded == {"a": b} and len(bad.errors) == 1
        assert "c on " in bad.errors[0] and "adapter_config.json is missing" in bad.errors[0]
        report = sync.status_of({"a": b, "c": str(tmp_path)}, [bad])
        assert report["workersInSync"] == "0/1" and report["message"] == bad.errors[0]
        # an adapter serving a stream refuses to unload; the next pass, after the stream, unloads it
        stream = server.client().completions.create(model="a", prompt=[5, 6, 7], max_tokens=250, temperature=0.0,
                                                    stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        busy = run({})
        assert not busy.in_sync and "in use" in busy.errors[0] and busy.loaded == {"a": b}
        assert sum(1 for c in chunks if c.choices) > 0  # the stream went on to its end
        assert run({}).in_sync and server.load()["lora_adapters"] == {}
    finally:
        server.stop()
    # a worker that does not answer: reported, not raised
    gone = run({"a": a})
    assert not gone.in_sync and "/load failed" in gone.errors[0]
    assert sync.status_of({"a": a}, [])["message"] == "no ready worker yet"
