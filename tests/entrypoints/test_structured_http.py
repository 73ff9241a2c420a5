"""Structured outputs and tool calling over HTTP: a real `pagefleet serve` on the bundled model, driven by the
real `openai` client; outputs checked with pydantic and jsonschema, streams against whole responses.

One server for the module (hermes tool calls, "auto" served, the qwen3 reasoning parser). The bundled 135M model
neither calls tools nor thinks on its own, so the auto and reasoning paths are driven by a regex that makes it
write a call or a <think> block; required and named calls are forced by the parser's grammar.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from servers import AUTH, KEY, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("structured") / "server.log", "--max-model-len", "1024",
               "--max-num-seqs", "32", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
               "--reasoning-parser", "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


def chats(server, requests: list[tuple[str, dict]]) -> list:
    """Requests sent at once (the engine batches them; one by one is minutes on two cores), in order."""
    async def run():
        aclient = server.aclient()
        return await asyncio.gather(*(chat_async(aclient, content, **kw) for content, kw in requests))

    return asyncio.run(run())


async def chat_async(aclient, content: str, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    if kw.pop("completion", False):
        return await aclient.completions.create(model="smol", prompt=content, **kw)
    return await aclient.chat.completions.create(model="smol", messages=[{"role": "user", "content": content}], **kw)


# ---- response_format: pydantic through parse(), json_schema, json_object ----

Word = Annotated[str, Field(max_length=12)]  # bounded strings and numbers: a 135M model can run on forever


class Address(BaseModel):
    city: Word
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: Word
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Word] = Field(max_length=3)


PROMPTS = [f"Describe {who} as JSON." for who in (
    "Alice, 30, from Paris", "Bob the admin in Berlin", "a guest called Chen", "my neighbour", "a pilot",
    "Dana who is 7", "a user from Rome", "the oldest person you know", "Eve, a guest", "someone in Oslo",
    "a baker aged 44", "Frank, admin, zip 10115", "a student", "Grace from Lagos", "a retired teacher",
    "Hiro in Tokyo", "an astronaut", "Ines, user, Lisbon", "a child of 3", "the mayor of Lyon")]


def test_parse_returns_a_valid_nested_instance_for_20_prompts(server):
    async def one(aclient, prompt):
        parse = aclient.chat.completions.parse
        return await parse(model="smol", messages=[{"role": "user", "content": prompt}], response_format=Person,
                           max_tokens=120, temperature=0)

    async def run():
        aclient = server.aclient()
        return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    results = asyncio.run(run())
    assert len({r.choices[0].message.content for r in results}) > 10  # different prompts, different people
    for r in results:
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert isinstance(c.message.parsed, Person)
        assert isinstance(c.message.parsed.address, Address)
        assert Person.model_validate_json(c.message.content) == c.message.parsed


ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "enum": ["tea", "coffee", "cake"]},
        "size": {"enum": ["S", "M", "L"]},
        "extras": {"type": "array", "items": {"type": "string", "enum": ["milk", "sugar", "ice"]},
                   "minItems": 1, "maxItems": 3},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["item", "size", "extras", "count"],
    "additionalProperties": False,
}


def test_json_schema_always_validates_greedy_and_sampled(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    kw = {"response_format": fmt, "max_tokens": 120}
    outs = chats(server, [(f"Order number {i}, please.", kw) for i in range(2)]
                 + [("Take my order.", {**kw, "temperature": 1.0, "seed": s}) for s in range(3)]
                 + [("Order as JSON:", {"completion": True, "max_tokens": 120, "temperature": 0.8, "seed": 1,
                                        "extra_body": {"response_format": fmt}})])
    texts = [o.choices[0].message.content if hasattr(o.choices[0], "message") else o.choices[0].text for o in outs]
    for text in texts:
        obj = json.loads(text)
        jsonschema.validate(obj, ORDER)
        assert set(obj) <= set(ORDER["properties"])
    assert len(set(texts)) > 1  # sampling took other paths through the grammar


def test_json_object_is_an_object(client):
    r = chat(client, "Any JSON you like.", response_format={"type": "json_object"}, max_tokens=40)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut off by max_tokens: still an object's prefix
        assert r.choices[0].message.content.startswith("{")


# ---- vLLM's structured_outputs and guided_* ----

def test_choice_and_regex_hold(server):
    choices = ["positive", "negative", "neutral"]
    pattern = r"[A-Z][a-z]{2,8}-\d{3}"
    days = r"(Mon|Tues|Wednes)day"
    outs = chats(server, [(f"Sentiment of: {text}", {"temperature": 0.7, "seed": i, "extra_body": (
        {"structured_outputs": {"choice": choices}} if i % 2 else {"guided_choice": choices})})
        for i, text in enumerate(["I love it", "This is awful", "It is a chair", "Great stuff!"])]
        + [("A product code:", {"temperature": 1.0, "seed": s,
                                "extra_body": {"structured_outputs": {"regex": pattern}}}) for s in range(4)]
        + [("Today is", {"completion": True, "max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 3,
                         "extra_body": {"guided_regex": days}})])
    assert all(o.choices[0].message.content in choices for o in outs[:4])
    assert all(re.fullmatch(pattern, o.choices[0].message.content) for o in outs[4:8])
    assert len(outs[8].choices) == 3 and all(re.fullmatch(days, c.text) for c in outs[8].choices)


def test_grammar_holds_streamed(client):
    grammar = 'root ::= "(" digit (("+" | "*") digit)* ")"\ndigit ::= [0-9]'
    stream = chat(client, "An arithmetic expression:", stream=True, max_tokens=20,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert re.fullmatch(r"\(\d([+*]\d)*\)", text)


# ---- tools ----

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What is the weather in Paris?", "Add 2 and 40.", "Is it cold in Oslo?", "What is 7 plus 8?"]


def check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_always_yields_a_valid_call(server):
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    for r in chats(server, [(ask, kw) for ask in ASKS[:2]] + [(ask, {**kw, "temperature": 1.0, "seed": 2})
                                                              for ask in ASKS[2:]]):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content
        assert len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0])


def test_named_function_always_yields_its_call(server):
    asks = [(ask, name) for ask in ASKS[1:3] for name in SCHEMAS]
    *outs, two = chats(server, [(ask, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": name}},
                                       "temperature": 0.8, "seed": len(ask)}) for ask, name in asks]
                       + [(ASKS[0], {"tools": TOOLS, "n": 2, "temperature": 1.0, "seed": 9,
                                     "tool_choice": {"type": "function", "function": {"name": "add"}}})])
    assert len(two.choices) == 2  # each sample its own matcher state
    for name, c in [(name, r.choices[0]) for (_, name), r in zip(asks, outs)] + [("add", c) for c in two.choices]:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], name)


def streamed_calls(stream):
    """Reassembled calls, and checks of the delta order: id, type and name first, then argument fragments."""
    calls, finish, content = {}, None, ""
    for chunk in stream:
        assert isinstance(chunk.model_extra.get("weight_version"), int)
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.id is None and not d.function.name
                    calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_and_whole_tool_calls_agree(client, choice):
    for ask in ASKS[:1] if isinstance(choice, dict) else ASKS[1:2]:
        kw = {"tools": TOOLS, "tool_choice": choice, "seed": 5, "parallel_tool_calls": False}
        whole = chat(client, ask, **kw).choices[0]
        calls, finish, content = streamed_calls(chat(client, ask, stream=True, **kw))
        assert finish == whole.finish_reason == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert len({c["id"] for c in calls}) == len(calls)


class Lookup(BaseModel):
    word: Word
    lang: Literal["en", "fr", "de"]


def test_the_sdks_stream_helper_parses_streamed_output_and_calls(client):
    """openai's own stream accumulator reads our deltas: a pydantic response_format, and a strict pydantic tool."""
    import openai

    messages = [{"role": "user", "content": "Describe Hiro in Tokyo as JSON."}]
    with client.chat.completions.stream(model="smol", messages=messages, response_format=Person, max_tokens=120,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)
    with client.chat.completions.stream(model="smol", messages=[{"role": "user", "content": "Look up 'chat'."}],
                                        tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60, temperature=0) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and isinstance(call.function.parsed_arguments, Lookup)


def test_auto_parses_a_call_the_model_writes(client):
    # The regex makes the model write a hermes call after some text; "auto" reads it back as a tool call.
    forced = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", ' \
             r'"unit": "celsius"\}\}\n</tool_call>'
    kw = {"tools": TOOLS, "tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": forced}},
          "max_tokens": 60}
    whole = chat(client, "Weather?", **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    check_call(whole.message.tool_calls[0], "get_weather")
    calls, finish, content = streamed_calls(chat(client, "Weather?", stream=True, **kw))
    assert finish == "tool_calls" and content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]
    plain = chat(client, "Say hi.", tools=TOOLS, max_tokens=8).choices[0]  # no call written: plain content
    assert plain.message.tool_calls is None and plain.message.content and plain.finish_reason != "tool_calls"


def test_tool_choice_none_shows_the_tools_and_reads_no_call(client):
    """As in vLLM: the prompt holds the tools (the server runs without --exclude-tools-when-tool-choice-none),
    and a call the model writes anyway stays content."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    kw = {"tools": TOOLS, "tool_choice": "none", "max_tokens": 60,
          "extra_body": {"structured_outputs": {"regex": re.escape(call)}}}
    r = chat(client, "Weather?", **kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content == call
    plain = chat(client, "Weather?", max_tokens=1).usage.prompt_tokens
    auto = chat(client, "Weather?", max_tokens=1, tools=TOOLS, tool_choice="auto").usage.prompt_tokens
    assert r.usage.prompt_tokens == auto > plain + 20


def test_a_conversation_with_earlier_calls_renders(client):
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_reasoning_content_is_split_whole_and_streamed(server, client):
    # SmolLM2 has no single </think> token, so the grammar holds from the first token (the server says so) and
    # can force the whole block
    with open(server.log_path) as f:
        assert "has no single </think> token" in f.read()
    forced = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[A-Z][a-z]{2,8}\."
    kw = {"extra_body": {"structured_outputs": {"regex": forced}}, "max_tokens": 40}
    whole = chat(client, "Think, then answer.", **kw).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]+", reasoning) and re.fullmatch(r"[A-Z][a-z]+\.", whole.content)
    parts = {"reasoning_content": "", "content": ""}
    for chunk in chat(client, "Think, then answer.", stream=True, **kw):
        for ch in chunk.choices:
            parts["content"] += ch.delta.content or ""
            parts["reasoning_content"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": whole.content}


# ---- bad requests: 400 in the OpenAI shape, naming the field, streamed or not ----

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 3}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_400s_naming_the_field(server, stream):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for extra, param in BAD:
            r = http.post("/v1/chat/completions", json={"model": "smol", "messages": MSG, "stream": stream, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
            assert param.split("[")[0].split(".")[0] in err["message"]
        r = http.post("/v1/completions", json={"model": "smol", "prompt": "hi", "response_format": {"type": "xml"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"



# ---- pagefleet bench serve --json-schema ----

def test_bench_serve_sends_the_schema_and_validates_every_output(server, tmp_path):
    schema = tmp_path / "order.json"
    schema.write_text(json.dumps(ORDER))
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
           "--input-len", "16", "--output-len", "120", "--concurrency", "3", "--num-requests", "3",
           "--prompt-format", "ids", "--json-schema", str(schema), "--json-out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["requests"], row["errors"], row["invalid_outputs"], row["cut_off_outputs"]) == (3, 0, 0, 0)
    assert row["output_tok_s"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "nonsense"}))
    done = subprocess.run([*cmd[:cmd.index("--json-schema") + 1], str(bad)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "not a valid JSON schema" in done.stderr
