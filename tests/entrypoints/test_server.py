"""The OpenAI-compatible server, end to end: a real `pagefleet serve` process on the bundled model,
driven by the real `openai` client, httpx and schemathesis, compared with the offline LLM.

Two server processes: `server` (64 sequences per step, API key) for the API and load tests, and
`small_server` (8 sequences, max queue 4, short context) for schemathesis, overload and SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import AUTH, KEY, Server

pytestmark = pytest.mark.slow

ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server") / "server.log", "--max-model-len", "256", "--max-num-seqs", "64",
               "--max-queue", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("small") / "server.log", "--max-model-len", "40", "--max-num-seqs", "8",
               "--max-queue", "4", "--drain-timeout", "60")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    from pagefleet.worker import LLM

    return LLM(max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


def greedy(max_tokens=16, **kw):
    from pagefleet.worker.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def stream_text(stream, chat: bool):
    """Concatenated deltas, finish reasons by choice, and the usage chunk."""
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


# ---- 1. same text as the offline LLM, exact usage, n, stop ----

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_completions_match_offline(server, llm, tokenizer):
    client = server.client()
    for prompt, ref in zip(PROMPTS, llm.generate(PROMPTS, greedy(16))):
        want = ref.outputs[0]
        r = client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids) == len(tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        stream = client.completions.create(model="smol", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        texts, finish, usage = stream_text(stream, chat=False)
        assert texts == {0: want.text} and finish == {0: want.finish_reason}
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(want.token_ids))


def test_chat_matches_offline(server, llm):
    client = server.client()
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2+2?"}]
    ref = llm.chat([messages], greedy(24))[0]
    want = ref.outputs[0]
    r = client.chat.completions.create(model="smol", messages=messages, max_completion_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(want.token_ids))

    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    texts, finish, usage = stream_text(stream, chat=True)
    assert texts == {0: want.text} and finish == {0: want.finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(want.token_ids))


def test_continue_final_message_and_no_generation_prompt_match_offline(server, llm):
    """vLLM's chat fields for the prompt: the reply goes on with the final assistant message (its text alone
    comes back), or the conversation is sent without the template's generation prompt."""
    client = server.client()
    opened = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
    for messages, fields in ((opened, {"add_generation_prompt": False, "continue_final_message": True}),
                             (opened[:1], {"add_generation_prompt": False})):
        ref = llm.chat([messages], greedy(12), **fields)[0]
        assert ref.prompt_token_ids == llm.tokenizer(
            llm.tokenizer.apply_chat_template(messages, tokenize=False, **fields), add_special_tokens=False).input_ids
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0,
                                           extra_body=fields)
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    # offline, the options the server answers with a 400 are a ValueError naming them
    refused = (({"continue_final_message": True}, "add_generation_prompt cannot both be true"),
               ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"))
    for fields, says in refused:
        with pytest.raises(ValueError, match=says):
            llm.chat([opened], greedy(1), **fields)
    plain = llm.chat([opened], greedy(1))[0].prompt_token_ids
    assert len(plain) > len(llm.chat([opened], greedy(1), add_generation_prompt=False,
                                     continue_final_message=True)[0].prompt_token_ids)


def test_n_choices_seed_and_usage(server):
    client = server.client()
    kw = dict(model="smol", prompt="My favourite colour is", max_tokens=8, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 8
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded sampling repeats

    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], n=3,
                                            max_tokens=5, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, finish, usage = stream_text(stream, chat=True)
    assert sorted(texts) == [0, 1, 2] and finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 15


def test_sampling_knobs_and_prompt_lists(server, tokenizer):
    """Every sampling field the issue names is accepted; several token-id prompts in one completions request
    come back as choices prompt-major, n per prompt."""
    client = server.client()
    r = client.completions.create(
        model="smol", prompt=[tokenizer.encode("Apples are"), tokenizer.encode("Bananas are")], n=2, max_tokens=5,
        temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2})
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tokenizer.encode("Apples are")) + len(tokenizer.encode("Bananas are"))
    assert r.usage.completion_tokens == 4 * 5 and all(c.finish_reason == "length" for c in r.choices)
    # top_k=1 is greedy whatever the temperature
    greedy_text = client.completions.create(model="smol", prompt="Apples are", max_tokens=6,
                                            temperature=0).choices[0].text
    top1 = client.completions.create(model="smol", prompt="Apples are", max_tokens=6, temperature=1.5,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy_text


def test_stop_across_token_boundary(server, llm, tokenizer):
    prompt = "The capital of France is"
    ref = llm.generate([prompt], greedy(32, ignore_eos=True))[0].outputs[0]
    ids, text = ref.token_ids, ref.text
    offsets = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    stop = None
    for k in range(1, len(ids) - 1):  # a stop string that starts inside token k-1 and ends inside token k
        a, b = offsets[k], offsets[k + 1]
        if a - offsets[k - 1] >= 2 and b - a >= 2:
            candidate = text[a - 1:a + 1]
            if text.find(candidate) == a - 1 and candidate.strip():
                stop = candidate
                break
    assert stop is not None, f"no boundary-spanning stop string in {text!r}"
    client = server.client()
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    texts, finish, _ = stream_text(stream, chat=False)
    assert texts == {0: text[: text.find(stop)]} and finish == {0: "stop"}
    # vLLM's include_stop_str_in_output: the text runs to the end of the stop string, streamed or not
    kept = text[: text.find(stop) + len(stop)]
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (kept, "stop")
    stream = client.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert stream_text(stream, chat=False)[:2] == ({0: kept}, {0: "stop"})
    offline = llm.generate([prompt], greedy(32, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert offline[0].outputs[0].text == kept


def test_logprobs(server):
    client = server.client()
    r = client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the chosen token is the best

    c = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_models_tokenize_detokenize(server, tokenizer):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smol"]
    ids = tokenizer.encode("Hello world")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 256
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=AUTH).json()
    assert r["prompt"] == "Hello world"


# ---- 2 + 5. 64 concurrent streams, batched together; metrics parse and move ----

def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as name{labels} -> value (name alone for the model_name-only series)."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            assert s.labels.get("model_name") == "smol", s
            key = s.name + ("" if not labels else json.dumps(labels, sort_keys=True))
            out[key] = s.value
    return out


async def test_64_concurrent_streams_are_batched(server):
    before = scrape(server.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "pagefleet:jump_forward_tokens_total"):
        assert name in before, name
    # the KV cache's settings as vLLM labels them (the bundled model serves with the default cache dtype)
    info_name = "vllm:cache_config_info"
    info = [json.loads(k.removeprefix(info_name)) for k in before if k.startswith(info_name)]
    assert len(info) == 1 and info[0]["cache_dtype"] == "auto" and info[0]["block_size"] == "16"
    assert int(info[0]["num_gpu_blocks"]) > 0 and before[info_name + json.dumps(info[0], sort_keys=True)] == 1
    client = server.aclient()
    seen = {"running": 0.0, "kv": 0.0}
    done = asyncio.Event()

    async def poll_metrics():
        async with httpx.AsyncClient() as http:
            while not done.is_set():
                text = (await http.get(server.url + "/metrics")).text
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name == "vllm:num_requests_running":
                            seen["running"] = max(seen["running"], s.value)
                        if s.name == "vllm:kv_cache_usage_perc":
                            seen["kv"] = max(seen["kv"], s.value)
                await asyncio.sleep(0.05)

    async def one(i):
        stream = await client.completions.create(
            model="smol", prompt=f"Request number {i} says", max_tokens=12, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, usage, finish

    poller = asyncio.create_task(poll_metrics())
    results = await asyncio.gather(*(one(i) for i in range(64)))
    done.set()
    await poller
    assert len(results) == 64
    for text, usage, finish in results:
        assert usage.completion_tokens == 12 and finish == "length" and text
    steps = httpx.get(server.url + "/debug/steps", headers=AUTH).json()
    max_batch = max(s["num_seqs"] for s in steps["recent_steps"])
    assert max_batch >= 48, f"at most {max_batch} sequences in one step"
    assert seen["running"] >= 8 and seen["kv"] > 0, seen  # the gauges moved under load

    after = scrape(server.url)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] >= 64 * 12
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    for h in ("time_to_first_token", "e2e_request_latency"):
        assert after[f"vllm:{h}_seconds_count"] - before[f"vllm:{h}_seconds_count"] >= 64
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] >= 64 * 11
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0


# ---- 3. bad input: 4xx with the OpenAI error shape, never a 500, server still answers ----

LONG = " ".join(["word"] * 400)  # > 256 tokens
BAD = [  # (path, body (dict or raw bytes), status, param)
    ("/v1/completions", b'{"model": "smol", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2, 3]", 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes please"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 16, "truncate_prompt_tokens": 241}, 400,
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "truncation_side": "left"}, 400, "truncation_side"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 2,
                              "truncation_side": "middle"}, 400, "truncation_side"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-3]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(server, path, body, status, param):
    kw = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_FIELDS and error["message"]
    assert error["param"] == param


def test_server_still_answers_after_bad_input(server):
    r = server.client().completions.create(model="smol", prompt="Still", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REFUSED = [  # (path, fields that change what is generated and that the server does not implement)
    ("/v1/chat/completions", {"tool_choice": "required"}),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}),
    ("/v1/chat/completions", {"function_call": "auto"}),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}),
    ("/v1/chat/completions", {"reasoning_effort": "high"}),
    ("/v1/chat/completions", {"web_search_options": {}}),
    ("/v1/chat/completions", {"verbosity": "low"}),
    ("/v1/chat/completions", {"best_of": 3}),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}),
    ("/v1/completions", {"allowed_token_ids": []}),
    ("/v1/completions", {"allowed_token_ids": [1, 10**7]}),
    ("/v1/completions", {"bad_words": ["  "]}),
    ("/v1/completions", {"prompt_logprobs": 21}),
    ("/v1/completions", {"chat_template_kwargs": {"enable_thinking": False}}),  # chat's fields, not completions'
    ("/v1/completions", {"continue_final_message": True}),
    # the bundled template reads no switch; continuing the final message excludes the generation prompt
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}),
    ("/v1/chat/completions", {"continue_final_message": True}),
    ("/v1/completions", {"logit_bias": {"x": 1}}),
    ("/v1/completions", {"logit_bias": {"1": 101}}),
    ("/v1/completions", {"logit_bias": {str(10**7): 1}}),
    ("/v1/completions", {"logit_bias": {str(t): 1 for t in range(301)}}),
]


@pytest.mark.parametrize("path,fields", REFUSED, ids=[next(iter(f)) for _, f in REFUSED])
def test_unsupported_generation_fields_get_a_400_naming_them(server, path, fields):
    body = {**(CHAT if "chat" in path else {"prompt": "hi"}), "max_tokens": 2, **fields}
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(fields))


def test_spaces_between_special_tokens_reaches_the_engine():
    """vLLM's spaces_between_special_tokens (a 400 before): the request's value is the engine's;
    tests/core/test_detokenizer.py has what it does to the text."""
    from pagefleet.worker.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, sampling_params

    for body in (CompletionRequest(prompt="hi", skip_special_tokens=False, spaces_between_special_tokens=False),
                 ChatCompletionRequest(messages=CHAT["messages"], spaces_between_special_tokens=False)):
        assert sampling_params(body, 2, None, 16, 1000).spaces_between_special_tokens is False
    assert sampling_params(CompletionRequest(prompt="hi"), 2, None, 16, 1000).spaces_between_special_tokens


def test_fields_that_ask_for_nothing_or_change_nothing_are_accepted(server):
    """The refused fields at their do-nothing values, and fields that change nothing generated."""
    body = {**CHAT, "max_tokens": 2, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "modalities": ["text"], "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "logit_bias": {}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_truncate_prompt_tokens_keeps_the_prompts_end_or_start(server, llm, tokenizer):
    """vLLM's truncate_prompt_tokens: the last k tokens (truncation_side "right": the first k), what the offline
    engine gives on those tokens; -1 keeps as many as fit beside max_tokens, so an overlong prompt is served."""
    client = server.client()
    ids = tokenizer.encode("The history of the printing press begins in the fifteenth century, when movable type")
    for side, kept in (("left", ids[-7:]), ("right", ids[:7]), (None, ids[-7:])):
        want = llm.generate([kept], greedy(8))[0].outputs[0].text
        extra = {"truncate_prompt_tokens": 7} | ({"truncation_side": side} if side else {})
        r = client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0, extra_body=extra)
        assert (r.choices[0].text, r.usage.prompt_tokens) == (want, 7), side
    long_prompt = ids * 30  # far past max_model_len (256)
    r = client.completions.create(model="smol", prompt=long_prompt, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1, "echo": True})
    assert r.usage.prompt_tokens == 256 - 8
    assert r.choices[0].text.startswith(tokenizer.decode(long_prompt[-248:]))  # echo shows what the model saw
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=4, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_logit_bias_is_honoured(server, llm, tokenizer):
    """+100 on one token makes every greedy token that one; -100 on the greedy first token gives the
    offline engine's choice with that bias."""
    client = server.client()
    target = tokenizer.encode(" banana")[0]
    r = client.completions.create(model="smol", prompt="Apples are", max_tokens=5, temperature=0,
                                  logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([target] * 5)
    first = llm.generate(["Apples are"], greedy(1))[0].outputs[0].token_ids[0]
    want = llm.generate(["Apples are"], greedy(3, logit_bias={first: -100}, ignore_eos=True))[0].outputs[0]
    assert want.token_ids[0] != first
    banned = client.completions.create(model="smol", prompt="Apples are", max_tokens=3, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text == want.text


def test_allowed_token_ids_are_honoured(server, llm, tokenizer):
    """vLLM's allowed_token_ids: greedy takes the best of the allowed, sampling never leaves them, chat too."""
    client = server.client()
    first = llm.generate(["Apples are"], greedy(1))[0].outputs[0].token_ids[0]
    allowed = [t for t in tokenizer.encode(" red green blue") if t != first]
    want = llm.generate(["Apples are"], greedy(6, allowed_token_ids=allowed, ignore_eos=True))[0].outputs[0]
    assert set(want.token_ids) <= set(allowed)
    r = client.completions.create(model="smol", prompt="Apples are", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].text == want.text
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Pick a colour."}],
                                       max_tokens=8, temperature=1.0, n=3, logprobs=True,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    words = {tokenizer.decode([t]) for t in allowed}
    for choice in r.choices:
        assert len(choice.logprobs.content) == 8 and {t.token for t in choice.logprobs.content} <= words


def test_bad_words_are_honoured(server, llm):
    """vLLM's bad_words: the offline engine's answer with the same words, on completions and chat alike."""
    client = server.client()
    prompt, words = "The capital of France is", ["Paris", "is a"]
    free = llm.generate([prompt], greedy(8))[0].outputs[0]
    want = llm.generate([prompt], greedy(8, bad_words=words, ignore_eos=True))[0].outputs[0]
    assert "Paris" in free.text and "Paris" not in want.text
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": words})
    assert r.choices[0].text == want.text
    # one-token words (bare and after a space), checked token by token in the sampled chat choices
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a big city."}],
                                       max_tokens=12, temperature=1.0, n=3, seed=1, logprobs=True,
                                       extra_body={"ignore_eos": True, "bad_words": ["Paris", "London"]})
    for choice in r.choices:
        assert not {t.token.strip() for t in choice.logprobs.content} & {"Paris", "London"}, choice.message.content


def test_api_key(server):
    for path in ("/v1/models",):
        assert httpx.get(server.url + path).status_code == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and set(r.json()["error"]) == ERROR_FIELDS
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    for probe in ("/health", "/ready", "/load", "/metrics"):
        assert httpx.get(server.url + probe).status_code == 200, probe


def test_schemathesis_finds_no_server_errors(small_server, tmp_path):
    """Fuzz every operation of the app's own OpenAPI schema; the only check: no 5xx, every request answered.
    (The small server: a short context keeps generated "valid" requests cheap; 8 workers batch them.)"""
    cmd = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
           "run", small_server.url + "/openapi.json", "--checks", "not_a_server_error",
           "--header", f"Authorization: Bearer {KEY}", "--max-examples", "10", "--request-timeout", "120",
           "--workers", "8",
           "--seed", "1", "--phases", "examples,coverage,fuzzing", "--exclude-path-regex", "^/(debug|metrics)"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    tested = re.search(r"Tested:\s+(\d+)", r.stdout)
    cases = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert tested and int(tested.group(1)) >= 7, r.stdout[-3000:]  # every POST and GET operation was reached
    assert cases and cases.group(1) == cases.group(2) and int(cases.group(1)) >= 200, r.stdout[-3000:]
    assert small_server.client().models.list().data  # and it still answers


# ---- 4. disconnects free blocks, overload gives 429 while accepted requests complete, SIGTERM drains ----

def wait_idle(server, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        load = server.load()
        if load["running"] == 0 and load["waiting"] == 0 and load["kv_cache_usage"] == 0:
            return load
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout} s: {server.load()}")


def test_disconnected_stream_frees_its_blocks(server):
    wait_idle(server, 10)
    body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                load = server.load()
                assert load["running"] == 1 and load["kv_cache_usage"] > 0, load
                break  # leaving the iteration early closes the connection (httpcore), ~197 tokens early
    closed_at = time.time()
    wait_idle(server, 3)
    assert time.time() - closed_at < 3
    aborts = scrape(server.url).get('vllm:request_success_total{"finished_reason": "abort"}', 0)
    assert aborts >= 1


def test_disconnected_non_streaming_request_is_aborted(server):
    wait_idle(server, 10)
    body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    wait_idle(server, 3)


async def test_overload_gets_429_and_accepted_requests_complete(small_server):
    client = small_server.aclient()

    async def one(i):
        try:
            r = await client.completions.create(model="smol", prompt=f"Number {i}", max_tokens=6,
                                                extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after") and e.body["code"] == "queue_full"
            return "429"

    results = await asyncio.gather(*(one(i) for i in range(40)))
    rejected = results.count("429")
    accepted = [r for r in results if r != "429"]
    assert rejected > 0 and len(accepted) >= 4, results
    assert accepted == [6] * len(accepted)  # every accepted request completed in full
    wait_idle(small_server, 5)


def test_sigterm_drains_in_flight_requests(small_server):
    """Runs last on the small server: it ends that process."""
    s = small_server
    body = {"prompt": "Count slowly:", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            async def stream_one():
                usage, finish = None, None
                async with http.stream("POST", s.url + "/v1/completions", json=body, headers=AUTH) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            usage = chunk.get("usage") or usage
                            for c in chunk["choices"]:
                                finish = c["finish_reason"] or finish
                return usage, finish

            streams = [asyncio.create_task(stream_one()) for _ in range(3)]
            while s.load()["running"] < 3:  # all three are decoding
                await asyncio.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await http.get(s.url + "/ready")
            new = await http.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=AUTH)
            assert not all(t.done() for t in streams), "drain checks must happen while requests are in flight"
            results = await asyncio.gather(*streams)
            return ready, new, results

    ready, new, results = asyncio.run(scenario())
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert new.status_code == 503 and set(new.json()["error"]) == ERROR_FIELDS
    for usage, finish in results:
        assert usage["completion_tokens"] == 24 and finish == "length"
    assert s.proc.wait(timeout=30) == 0


def test_bench_serve_reports_every_level_and_traces_it(server, tmp_path):
    """`pagefleet bench serve` against the real server: every request completes with its token count, and
    --trace-out lines each request's times up with the server's own steps."""
    out, trace_out = tmp_path / "bench.json", tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
           "--input-len", "24", "--output-len", "6", "--concurrency", "1", "4", "--num-requests", "8",
           "--prompt-format", "ids", "--json-out", str(out), "--trace-out", str(trace_out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| concurrency | TTFT p50 / p99 (ms)" in done.stdout
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert (r["requests"], r["errors"], r["short_outputs"]) == (8, 0, 0)
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["output_tok_s"] > 0
        assert 0 < r["tpot_p50_ms"] <= 1e3 * r["wall_s"] / 5  # 5 gaps after the first token, in one level
    levels = json.loads(trace_out.read_text())
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv, r in zip(levels, rows):
        reqs = lv["requests"]
        assert len(reqs) == 8 and all(q["error"] is None and q["output_tokens"] == 6 for q in reqs)
        assert all(0 <= q["start_s"] < q["start_s"] + q["ttft_s"] <= q["end_s"] <= r["wall_s"] + 0.5 for q in reqs)
        steps = lv["server_steps"]
        # every request's prompt (24 tokens) and its 5 decodes after the first token ran in this level's steps
        assert sum(st["num_prefill_tokens"] for st in steps) == 8 * 24
        assert all(0 <= st["start_s"] <= r["wall_s"] for st in steps)
    assert max(st["num_seqs"] for st in levels[1]["server_steps"]) > 1  # concurrency 4 was batched


def test_bench_serve_open_loop_paces_arrivals_at_each_request_rate(server, tmp_path):
    """--request-rate: requests arrive at Poisson times (seeded) whatever is in flight. At 4/s the level lasts
    at least as long as its drawn gaps; at 1000/s they all land at once and are in flight together."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
           "--input-len", "24", "--output-len", "6", "--request-rate", "4", "1000", "--num-requests", "6",
           "--prompt-format", "ids", "--seed", "3", "--json-out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| request rate (/s) | TTFT p50 / p99 (ms)" in done.stdout and "| most in flight |" in done.stdout
    rows = json.loads(out.read_text())
    assert [(r["request_rate"], r["concurrency"]) for r in rows] == [(4, None), (1000, None)]
    for r in rows:
        assert (r["requests"], r["errors"], r["short_outputs"]) == (6, 0, 0)
    gaps = random.Random(3 + 1)  # the bench's arrival draws: 5 gaps a level
    assert rows[0]["wall_s"] >= sum(gaps.expovariate(4) for _ in range(5))
    assert rows[1]["max_in_flight"] > 1
    for bad in ("0", "nan"):
        refused = subprocess.run(cmd[:-2] + ["--request-rate", "4", bad], capture_output=True, text=True, cwd=tmp_path,
                                 timeout=120)
        assert refused.returncode == 2 and f"--request-rate must be > 0 (inf: all at once), got {bad}" in refused.stderr


def test_bench_serve_sends_its_sampling_fields(server, tmp_path):
    """--temperature / --top-p / --top-k / --min-p reach the server: sampled requests complete, and a top_p the
    server refuses fails every request with the server's message naming the field."""
    cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
           "--input-len", "16", "--output-len", "4", "--concurrency", "2", "--num-requests", "4",
           "--prompt-format", "ids", "--temperature", "1", "--top-k", "5", "--min-p", "0.01"]
    done = subprocess.run(cmd + ["--top-p", "0.9"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = subprocess.run(cmd + ["--top-p", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert refused.returncode == 1 and "4 errors" in refused.stderr and "top_p" in refused.stderr


@pytest.mark.parametrize("flag", ["--json-out", "--trace-out"])
def test_bench_serve_refuses_an_output_path_it_could_not_write_before_running(tmp_path, flag):
    cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", "http://127.0.0.1:9",
           flag, str(tmp_path / "missing" / "out.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and f"{flag} " in done.stderr and "is not a writable folder" in done.stderr
    assert "Traceback" not in done.stderr  # refused before it tried to reach the (absent) server
