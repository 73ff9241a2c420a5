"""Structured outputs, tools and scoring requests through the gateway: the real LiteLLM proxy (`pagefleet gateway`)
in front of one real `pagefleet serve`, driven by the real `openai` client; response_format, tools, echo and
prompt_logprobs reach the worker and what comes back validates."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_gateway_e2e import MASTER_KEY, MODEL, gateway, worker

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "green", "blue"]},
    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99}, "maxItems": 3}},
    "required": ["color", "sizes"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-structured")
    w = worker(tmp, 0)
    g = gateway(tmp, "ours", [w], "queue-depth")
    try:
        w.wait_ready()
        g.wait_ready()
        yield g
    finally:
        g.stop()
        w.stop()


def client(g) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key=MASTER_KEY, max_retries=0, timeout=120)


def test_response_format_passes_through(gw):
    c = client(gw)
    fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA, "strict": True}}
    for content in ("Describe a shirt.", "Pick sizes."):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                      response_format=fmt, max_tokens=60, temperature=0)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A shirt."}],
                                       response_format=fmt, max_tokens=60, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_tools_pass_through(gw):
    c = client(gw)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Look up 'cat'."}],
                                  tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}},
                                  max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


def test_a_bad_response_format_is_a_400_from_the_worker(gw):
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400
    assert "response_format.json_schema.schema" in r.text


def test_vllms_chat_fields_pass_through(gw):
    """chat_template_kwargs, add_generation_prompt / continue_final_message and include_stop_str_in_output reach
    the worker through LiteLLM: a partial assistant turn is continued (fewer prompt tokens than a new turn), the
    stop string stays in the text, and a switch the template never reads comes back as the worker's 400."""
    c = client(gw)
    opened = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite is"}]
    new_turn = c.chat.completions.create(model=MODEL, messages=opened, max_tokens=4, temperature=0)
    go_on = c.chat.completions.create(model=MODEL, messages=opened, max_tokens=4, temperature=0,
                                      extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert 0 < go_on.usage.prompt_tokens < new_turn.usage.prompt_tokens
    free = c.chat.completions.create(model=MODEL, messages=opened[:1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].message.content
    stop = free.strip()[:2]
    kept = c.chat.completions.create(model=MODEL, messages=opened[:1], max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == free[: free.find(stop) + len(stop)]
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"}, timeout=60,
                   json={"model": MODEL, "messages": opened[:1], "max_tokens": 2,
                         "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and "chat_template_kwargs.enable_thinking" in r.text


def test_scoring_requests_pass_through(gw):
    """lm-eval-harness's local-completions loglikelihood request (token-id prompts, echo, logprobs 1, max_tokens 1)
    and vLLM's prompt_logprobs come back through LiteLLM as the worker sends them, with the same scores."""
    from transformers import AutoTokenizer

    from pagefleet.worker.models.loader import bundled_model_path

    ids = AutoTokenizer.from_pretrained(bundled_model_path()).encode("The capital of France is")
    r = client(gw).completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0)
    choices = sorted(r.choices, key=lambda ch: ch.index)
    for choice, prompt in zip(choices, [ids, ids[:3]], strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
        assert lp.top_logprobs[0] is None and all(len(top) >= 1 for top in lp.top_logprobs[1:])
    body = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {MASTER_KEY}"}, timeout=60,
                      json={"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert all(str(t) in entry for t, entry in zip(ids[1:], scored[1:], strict=True))
    assert choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scored[1:], strict=True)], abs=1e-4)
