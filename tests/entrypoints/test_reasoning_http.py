"""A reasoning model's structured outputs over HTTP: `pagefleet serve --reasoning-parser qwen3` on a tiny random
Qwen3 whose vocabulary has `<think>` / `</think>` (think_models.py), driven by the real `openai` client.

The constraint applies after `</think>`: a reply still reasoning is unconstrained (the same tokens as without the
constraint), one that ends its reasoning gets the constrained answer as its content, and a prompt whose template
already closed the block is constrained from the first token. A random model never ends its reasoning on its
own, so a logit_bias on `</think>` makes it end at once where the test needs an answer. The server also runs with
--exclude-tools-when-tool-choice-none.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from servers import AUTH, Server
from think_models import think_model

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = think_model(tmp_path_factory.mktemp("think-model"))
    s = Server(tmp_path_factory.mktemp("reasoning") / "server.log", "--model", str(folder), "--max-model-len", "512",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--exclude-tools-when-tool-choice-none")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def end_id(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}, headers=AUTH)
    (token,) = r.json()["tokens"]
    return token


def chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


def test_a_reply_still_reasoning_is_unconstrained(client):
    free = chat(client, "Count. /think", max_tokens=10).choices[0]
    gated = chat(client, "Count. /think", max_tokens=10, response_format=JSON_SCHEMA).choices[0]
    assert free.finish_reason == gated.finish_reason == "length"
    assert gated.message.model_extra["reasoning_content"] == free.message.model_extra["reasoning_content"]
    assert gated.message.content == ""


def test_after_the_reasoning_the_content_validates_whole_and_streamed(client, end_id):
    kw = {"response_format": JSON_SCHEMA, "logit_bias": {str(end_id): 100}, "n": 2, "temperature": 1.0, "seed": 1}
    whole = chat(client, "Count. /think", **kw)
    for c in whole.choices:
        assert c.finish_reason == "stop" and c.message.model_extra["reasoning_content"] == ""
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    parts = {0: "", 1: ""}
    for chunk in chat(client, "Count. /think", stream=True, **kw):
        for ch in chunk.choices:
            parts[ch.index] += ch.delta.content or ""
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]


def test_a_prompt_that_closed_the_block_is_constrained_from_the_start(client):
    c = chat(client, "Count. /no_think", response_format=JSON_SCHEMA).choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_enable_thinking_false_through_chat_template_kwargs_is_constrained_from_the_start(server, client):
    """Qwen3's switch as clients send it (vLLM's chat_template_kwargs): the template closes the block itself, so
    the schema holds from the first token; /tokenize renders the same prompt, and a misspelt switch is a 400."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    c = chat(client, "Count.", response_format=JSON_SCHEMA, extra_body=off).choices[0]
    assert c.finish_reason == "stop" and not c.message.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    messages = [{"role": "user", "content": "Count."}]
    rendered = [httpx.post(server.url + "/tokenize", json={"messages": messages, **kw}, headers=AUTH).json()["tokens"]
                for kw in ({}, off)]
    closed = httpx.post(server.url + "/tokenize", headers=AUTH,
                        json={"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False}).json()["tokens"]
    assert rendered[1] == rendered[0] + closed
    assert chat(client, "Count.", max_tokens=1, extra_body=off).usage.prompt_tokens == len(rendered[1])
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"enable_thinkng": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "enable_thinkng" in r.json()["error"]["message"]


def test_required_tool_calls_come_after_the_reasoning(client, end_id):
    c = chat(client, "Weather in Rome? /think", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
             logit_bias={str(end_id): 100}, max_tokens=120).choices[0]  # the call's JSON allows blanks
    assert c.finish_reason == "tool_calls" and c.message.model_extra["reasoning_content"] == ""
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Rome", "Paris")


def test_tool_choice_none_leaves_the_tools_out_with_the_flag(client):
    plain = chat(client, "Weather in Rome?", max_tokens=1).usage.prompt_tokens
    none = chat(client, "Weather in Rome?", max_tokens=1, tools=TOOLS, tool_choice="none").usage.prompt_tokens
    shown = chat(client, "Weather in Rome?", max_tokens=1, tools=TOOLS,
                 tool_choice="required").usage.prompt_tokens
    assert none == plain and shown > plain + 10


def test_include_reasoning_false_leaves_the_reasoning_out(server, client, end_id):
    """vLLM's include_reasoning: false: the same generation, the reasoning dropped from the answer, whole and
    streamed; the token-level fields that would show it are 400s."""
    hide = {"include_reasoning": False}
    kw = {"logit_bias": {str(end_id): 100}, "response_format": JSON_SCHEMA}  # reasons, ends it, then answers
    shown = chat(client, "Count. /think", **kw).choices[0]
    hidden = chat(client, "Count. /think", extra_body=hide, **kw).choices[0]
    assert "reasoning_content" in shown.message.model_extra and "reasoning_content" not in hidden.message.model_extra
    assert hidden.message.content == shown.message.content
    jsonschema.validate(json.loads(hidden.message.content), SCHEMA)
    still = chat(client, "Count. /think", max_tokens=10, extra_body=hide).choices[0]  # never ends its reasoning
    assert still.message.content == "" and "reasoning_content" not in still.message.model_extra
    streamed = ""
    for chunk in chat(client, "Count. /think", stream=True, extra_body=hide, **kw):
        for ch in chunk.choices:
            assert "reasoning_content" not in (ch.delta.model_extra or {})
            streamed += ch.delta.content or ""
    assert streamed == hidden.message.content
    for field, value in (("logprobs", True), ("return_token_ids", True), ("prompt_logprobs", 1)):
        r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "Count. /think"}], "max_tokens": 2, "include_reasoning": False,
            field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
