"""`pagefleet serve` on the hybrid model (tiny random Qwen3.5, CPU): a repeated 200-token prompt hits the prefix
cache (KV blocks and the DeltaNet state snapshot), the hit is counted in /metrics under vLLM's names, and the
repeat's tokens equal the cold run's and transformers' own."""

import re

import httpx
import pytest

from engine_models import hf_greedy, tiny_qwen3_5
from servers import AUTH, Server

pytestmark = pytest.mark.slow


def counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_repeated_200_token_prompt_hits_and_is_counted(tmp_path):
    path = tiny_qwen3_5(tmp_path / "qwen3_5")
    prompt = [(11 * i + 7) % 500 + 3 for i in range(200)]
    want = hf_greedy(path, [prompt], 8)[0]
    server = Server(tmp_path / "serve.log", "--model", str(path), "--device", "cpu", "--max-model-len", "256")
    try:
        def complete() -> list[int]:
            body = {"model": "smol", "prompt": prompt, "max_tokens": 8, "min_tokens": 8, "temperature": 0,
                    "logprobs": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        def metrics() -> tuple[float, float]:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            return counter(text, "vllm:prefix_cache_queries_total"), counter(text, "vllm:prefix_cache_hits_total")

        cold = complete()
        queries0, hits0 = metrics()
        warm = complete()
        queries1, hits1 = metrics()
        assert hits1 - hits0 >= 192, "the 200-token repeat should hit 12 full blocks of 16 (192 tokens)"
        assert queries1 - queries0 >= 200
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert warm["choices"][0]["logprobs"]["tokens"] == cold["choices"][0]["logprobs"]["tokens"]
        assert cold["usage"]["completion_tokens"] == len(want) == 8
        from transformers import AutoTokenizer

        assert cold["choices"][0]["text"] == AutoTokenizer.from_pretrained(str(path)).decode(want)
    finally:
        server.stop()
