"""vLLM's request fields that shape the answer rather than the tokens, through ASGI on a tiny Llama: the token ids
beside the text (return_token_ids), logprob tokens spelt as ids (return_tokens_as_token_ids), usage in every chunk
(stream_options.continuous_usage_stats), a prefix-cache salt (cache_salt); and the vLLM fields we do not
implement, each a 400 naming it rather than a silent ignore."""

from __future__ import annotations

import json

import httpx
import pytest

from asgi_app import post, worker_app
from pagefleet.worker import LLM, SamplingParams

PROMPT = list(range(300, 340))
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def app(tiny_models):
    with worker_app(tiny_models["llama"], dict(max_model_len=256, device="cpu"),
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}") as app:
        yield app


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


SAMPLED = dict(model="smol", max_tokens=12, n=2, seed=5, temperature=1.0, ignore_eos=True)


async def test_return_token_ids_whole_and_streamed(app):
    whole = await post(app, "/v1/completions", prompt=PROMPT, return_token_ids=True, **SAMPLED)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT, PROMPT]
    assert [len(c["token_ids"]) for c in choices] == [12, 12] and choices[0]["token_ids"] != choices[1]["token_ids"]
    chunks = events(await post(app, "/v1/completions", prompt=PROMPT, return_token_ids=True, stream=True,
                               stream_options={"include_usage": True, "continuous_usage_stats": True}, **SAMPLED))
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts_sent = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        streamed[c["index"]] += c["token_ids"]
        prompts_sent[c["index"]] += "prompt_token_ids" in c
        # vLLM's continuous usage: this choice's prompt and its tokens so far
        assert chunk["usage"] == {"prompt_tokens": 40, "completion_tokens": len(streamed[c["index"]]),
                                  "total_tokens": 40 + len(streamed[c["index"]])}
    assert streamed == {0: choices[0]["token_ids"], 1: choices[1]["token_ids"]}  # seeded: the same samples
    assert prompts_sent == {0: 1, 1: 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    plain = await post(app, "/v1/completions", prompt=PROMPT, **SAMPLED)
    assert "token_ids" not in plain.json()["choices"][0]  # only when asked


async def test_chat_token_ids_and_ids_as_logprob_tokens(app):
    body = dict(messages=CHAT, return_token_ids=True, return_tokens_as_token_ids=True, logprobs=True,
                top_logprobs=2, **SAMPLED)
    whole = (await post(app, "/v1/chat/completions", **body)).json()
    assert whole["prompt_token_ids"] and all(len(c["token_ids"]) == 12 for c in whole["choices"])
    for c in whole["choices"]:
        content = c["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in c["token_ids"]]
        assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    chunks = events(await post(app, "/v1/chat/completions", stream=True, **body,
                               stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "prompt_token_ids" in chunks[0] and sum("prompt_token_ids" in c for c in chunks) == 1
    prompt_tokens = len(whole["prompt_token_ids"])
    assert chunks[0]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                  "total_tokens": prompt_tokens}  # the role chunks, as vLLM sends them
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for c in chunk["choices"]:
            streamed[c["index"]] += c.get("token_ids") or []
    assert streamed == {i: c["token_ids"] for i, c in enumerate(whole["choices"])}


async def test_beam_search_returns_token_ids(app):
    r = await post(app, "/v1/completions", model="smol", prompt=PROMPT, n=2, max_tokens=4, use_beam_search=True,
                   ignore_eos=True, return_token_ids=True)
    assert r.status_code == 200, r.text
    assert all(c["prompt_token_ids"] == PROMPT and len(c["token_ids"]) == 4 for c in r.json()["choices"])


def test_cache_salt_keeps_prefix_cache_entries_apart(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, device="cpu")
    prompt = list(range(500, 600))  # six full blocks of 16

    def cached(salt):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, cache_salt=salt))
        return out.num_cached_tokens

    assert cached(None) == 0 and cached(None) == 96
    assert cached("tenant-a") == 0 and cached("tenant-a") == 96  # a salt meets only its own entries
    assert cached("tenant-b") == 0 and cached(None) == 96
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="").validate(1000)


async def test_cache_salt_over_http(app):
    blocks = app.state.server.engine.engine.block_manager
    prompt = list(range(700, 740))  # 40 tokens: two full blocks can hit
    for salt, want in ((None, 0), ("s1", 0), ("s1", 32), ("s2", 0), (None, 32)):
        before = blocks.prefix_hits
        r = await post(app, "/v1/completions", model="smol", prompt=prompt, max_tokens=1,
                       **({} if salt is None else {"cache_salt": salt}))
        assert r.status_code == 200 and blocks.prefix_hits - before == want, (salt, r.text)
    bad = await post(app, "/v1/completions", model="smol", prompt=PROMPT, max_tokens=1, cache_salt="")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text


@pytest.mark.parametrize("fields", [
    {"prompt_embeds": "AAAA"}, {"priority": 1}, {"logprob_token_ids": [5]}, {"vllm_xargs": {"k": 1}},
    {"kv_transfer_params": {"do_remote_prefill": True}}, {"return_token_offsets": True},
    {"thinking_token_budget": 10},
])
async def test_vllm_fields_we_do_not_implement_are_400s(app, fields):
    r = await post(app, "/v1/completions", model="smol", prompt=PROMPT, max_tokens=2, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(fields)), r.text
    ok = await post(app, "/v1/completions", model="smol", prompt=PROMPT, max_tokens=2, priority=0)
    assert ok.status_code == 200, ok.text  # the value that asks for nothing


@pytest.mark.parametrize("fields", [{"return_assistant_tokens_mask": True}, {"mm_processor_kwargs": {"size": 1}}])
async def test_chat_fields_we_do_not_implement_are_400s(app, fields):
    r = await post(app, "/v1/chat/completions", model="smol", messages=CHAT, max_tokens=2, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(fields)), r.text
    # no reasoning parser here, so there is no reasoning to leave out (test_reasoning_http.py has one)
    ok = await post(app, "/v1/chat/completions", model="smol", messages=CHAT, max_tokens=2, include_reasoning=False,
                    request_id="mine")
    assert ok.status_code == 200, ok.text
