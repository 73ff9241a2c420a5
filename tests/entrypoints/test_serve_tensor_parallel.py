"""`pagefleet serve --tensor-parallel-size 2` on CPU (gloo): the real openai client gets the tokens an offline
engine of one rank gives; a model whose heads do not split is refused at start-up with exit code 2 and a line
naming its sizes (what the operator shows as the pod's termination message)."""

import subprocess
import sys

import pytest

from engine_models import tiny_model
from pagefleet.worker import LLM, SamplingParams
from servers import Server

pytestmark = pytest.mark.slow


def test_two_ranks_serve_the_tokens_of_one(tmp_path):
    path = tiny_model("llama", tmp_path / "llama")
    prompt = [1, 17, 33, 250, 9, 4000, 12]
    want = LLM(str(path), device="cpu", max_model_len=128).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(want.token_ids) == 8 and want.text
    server = Server(tmp_path / "serve.log", "--model", str(path), "--device", "cpu", "--max-model-len", "128",
                    "--tensor-parallel-size", "2")
    try:
        client = server.client()
        for stream in (False, True):
            out = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0, stream=stream,
                                            extra_body={"ignore_eos": True})
            text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
            assert text == want.text
    finally:
        server.stop()


def test_heads_that_do_not_split_are_refused_at_start_up(tmp_path):
    # the bundled SmolLM2-135M has 9 attention heads
    done = subprocess.run([sys.executable, "-m", "pagefleet", "serve", "--device", "cpu", "--tensor-parallel-size",
                           "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pagefleet serve: tensor_parallel_size 2 does not divide the model's 9 attention heads" in done.stdout
