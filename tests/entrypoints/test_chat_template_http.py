"""Chat prompts and replies beyond the checkpoint's template: the server's --chat-template (a file or inline), a
request's own chat_template where the server runs with --trust-request-chat-template (a 400 naming the field
otherwise, as in vLLM), and vLLM's chat `echo`. Two apps in this process over one tiny Llama engine, through
ASGI."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from asgi_app import post
from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.entrypoints.api_server import build_app
from pagefleet.worker.entrypoints.chat_template import load_chat_template

SERVER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")
REQUEST_TEMPLATE = "<<{% for m in messages %}{{ m['content'] }}{% endfor %}>>"
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def engine(tiny_models):
    from pagefleet.worker.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_models["llama"]), max_model_len=256,
                                         kv_cache_memory_bytes=1 << 24))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def trusting(engine):
    return build_app(engine, "smol", chat_template=SERVER_TEMPLATE, trust_request_chat_template=True)


@pytest.fixture(scope="module")
def plain(engine):
    return build_app(engine, "smol")


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def test_the_servers_template_replaces_the_checkpoints(engine, trusting, plain):
    r = await post(trusting, "/tokenize", messages=MESSAGES)
    assert r.status_code == 200 and r.json()["tokens"] == encode(engine, "[user] hello there\n[assistant]")
    own = await post(plain, "/tokenize", messages=MESSAGES)  # the same engine's tokenizer is left as it was
    assert own.status_code == 200 and own.json()["tokens"] != r.json()["tokens"]
    chat = await post(trusting, "/v1/chat/completions", model="smol", messages=MESSAGES, max_tokens=2)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(r.json()["tokens"])


async def test_a_trusted_request_brings_its_own_template(engine, trusting):
    want = encode(engine, "<<hello there>>")
    r = await post(trusting, "/tokenize", messages=MESSAGES, chat_template=REQUEST_TEMPLATE)
    assert r.status_code == 200 and r.json()["tokens"] == want
    chat = await post(trusting, "/v1/chat/completions", model="smol", messages=MESSAGES, max_tokens=2,
                      chat_template=REQUEST_TEMPLATE)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(want)
    bad = await post(trusting, "/v1/chat/completions", model="smol", messages=MESSAGES, max_tokens=2,
                     chat_template="{% for m in messages %}")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text
    # a template's own switches are checked against the request's template, not the server's
    kwargs = await post(trusting, "/tokenize", messages=MESSAGES, chat_template="{{ greeting }}",
                        chat_template_kwargs={"greeting": "hi"})
    assert kwargs.status_code == 200 and kwargs.json()["tokens"] == encode(engine, "hi")


async def test_an_untrusting_server_refuses_a_requests_template(plain):
    for path, body in (("/v1/chat/completions", {"model": "smol", "max_tokens": 2}), ("/tokenize", {})):
        r = await post(plain, path, messages=MESSAGES, chat_template=REQUEST_TEMPLATE, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    completion = await post(plain, "/v1/completions", model="smol", prompt="hi", max_tokens=2,
                            chat_template=REQUEST_TEMPLATE)  # completions have no chat prompt to template
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "chat_template"


def test_chat_template_flag_reads_a_file_or_an_inline_template(tmp_path, capsys):
    path = tmp_path / "template.jinja"
    path.write_text(SERVER_TEMPLATE)
    assert load_chat_template(str(path)) == SERVER_TEMPLATE
    assert load_chat_template(REQUEST_TEMPLATE) == REQUEST_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    from pagefleet.worker.entrypoints.serve import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--chat-template", str(tmp_path / "missing.jinja")])) == 2  # before any engine
    assert "neither a file nor a Jinja template" in capsys.readouterr().out


CONTINUED = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "The answer is"}]


def streamed_content(response: httpx.Response) -> list[str]:
    """Each streamed chunk's content delta (empty where it has none), choice 0."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices:
                out.append(choices[0]["delta"].get("content") or "")
    return out


async def test_chat_echo_starts_the_reply_with_the_continued_turn(trusting):
    """vLLM's echo: the last message's content leads the reply's where it has the reply's role (a continued
    assistant turn, add_generation_prompt false); streamed, it leads the first content delta. Otherwise the reply
    is as without echo."""
    body = dict(model="smol", messages=CONTINUED, add_generation_prompt=False, continue_final_message=True,
                max_tokens=4, temperature=0, ignore_eos=True)
    plain = (await post(trusting, "/v1/chat/completions", **body)).json()["choices"][0]["message"]["content"]
    echoed = await post(trusting, "/v1/chat/completions", echo=True, n=2, **body)
    assert echoed.status_code == 200, echoed.text
    assert [c["message"]["content"] for c in echoed.json()["choices"]] == ["The answer is" + plain] * 2
    stream = await post(trusting, "/v1/chat/completions", echo=True, stream=True, **body)
    deltas = [d for d in streamed_content(stream) if d]
    assert deltas[0].startswith("The answer is") and "".join(deltas) == "The answer is" + plain
    # a reply to a user turn: the user's words are not the reply's, so nothing leads it
    asked = dict(model="smol", messages=CONTINUED[:1], max_tokens=4, temperature=0, ignore_eos=True)
    without = (await post(trusting, "/v1/chat/completions", **asked)).json()["choices"][0]["message"]["content"]
    with_echo = await post(trusting, "/v1/chat/completions", echo=True, **asked)
    assert with_echo.json()["choices"][0]["message"]["content"] == without


DOCS_TEMPLATE = ("{% for d in documents or [] %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")


async def test_documents_reach_a_template_that_reads_them_and_are_refused_elsewhere(engine, plain):
    reads = build_app(engine, "smol", chat_template=DOCS_TEMPLATE)
    docs = [{"title": "tides", "text": "the moon pulls the sea"}, {"title": "bees", "text": "bees dance"}]
    r = await post(reads, "/v1/chat/completions", model="smol", messages=MESSAGES, documents=docs, max_tokens=2)
    want = encode(engine, "<doc tides>the moon pulls the sea</doc><doc bees>bees dance</doc>hello there")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
    bare = await post(reads, "/v1/chat/completions", model="smol", messages=MESSAGES, max_tokens=2)
    assert bare.json()["usage"]["prompt_tokens"] == len(encode(engine, "hello there"))
    for app, path, body in ((plain, "/v1/chat/completions", {"messages": MESSAGES}),  # its template has none
                            (reads, "/v1/completions", {"prompt": "hello"})):  # no template at all
        refused = await post(app, path, model="smol", documents=docs, max_tokens=2, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents", refused.text
