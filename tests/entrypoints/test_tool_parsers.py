"""Tool-call and reasoning parsers on fixed texts: whole-text extraction, and streams fed one character at a
time that reassemble to the same calls and content."""

import json

import pytest

from pagefleet.worker.entrypoints.reasoning import ReasoningStreamer, split_reasoning
from pagefleet.worker.entrypoints.tool_parsers import default_parser_name, tool_parser

WEATHER = {"city": "Paris", "days": [1, 2], "unit": "c"}
TIME = {"zone": "UTC"}

W, T = json.dumps(WEATHER), json.dumps(TIME)
CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": ' + W + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "time", "arguments": ' + T + '}\n</tool_call>', "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "weather", "parameters": ' + W + '}; {"name": "time", "parameters": '
                    + T + '}', None),
    "mistral": ('Checking. [TOOL_CALLS][{"name": "weather", "arguments": ' + W + '}, {"name": "time", "arguments": '
                + T + '}]', "Checking."),
}


def streamed(parser, text):
    s = parser.streamer()
    content, calls = "", {}
    for ch in list(text) + [None]:
        c, items = s.finish() if ch is None else s.feed(ch)
        content += c
        for it in items:
            call = calls.setdefault(it["index"], {"id": it.get("id"), "name": "", "arguments": ""})
            if "id" in it:
                assert call["id"] == it["id"] and it["type"] == "function"
                call["name"] = it["function"]["name"]
            call["arguments"] += it["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_extract_and_stream_agree_on_two_calls(name):
    parser = tool_parser(name)
    text, content = CASES[name]
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", WEATHER), ("time", TIME)]
    assert all(c.to_openai()["id"].startswith("call_") for c in calls)
    s_content, s_calls = streamed(parser, text)
    assert s_content.strip() == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == [("weather", WEATHER), ("time", TIME)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_and_cut_off_calls_stay_content(name):
    parser = tool_parser(name)
    assert parser.extract("Just an answer.") == ("Just an answer.", [])
    text = CASES[name][0]
    cut = text[: text.index('"days"')]
    assert parser.extract(cut) == (cut, [])


def test_hermes_arguments_that_are_not_an_object_are_content():
    text = '<tool_call>{"name": "weather", "arguments": [1, 2]}</tool_call>'
    assert tool_parser("hermes").extract(text) == (text, [])


def test_default_parser_follows_the_model_type():
    assert default_parser_name("llama") == "llama3_json"
    assert default_parser_name("mistral") == "mistral"
    assert default_parser_name("qwen3") == "hermes"


def test_reasoning_split_whole_and_streamed():
    text = "<think>\nadd 2 and 2\n</think>\n\nThe answer is 4."
    assert split_reasoning(text, in_reasoning=False) == ("add 2 and 2\n", "The answer is 4.")
    assert split_reasoning("no thinking here", in_reasoning=False) == (None, "no thinking here")
    # a prompt that opened <think> leaves the reply inside it until </think>
    assert split_reasoning("still thinking", in_reasoning=True) == ("still thinking", "")
    s = ReasoningStreamer(in_reasoning=False)
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(r for r, _ in parts) == "add 2 and 2\n"
    assert "".join(c for _, c in parts) == "The answer is 4."


@pytest.mark.parametrize("name, text", [
    ("llama3_json", '{"name": "time", "parameters": {"zone": "UTC"}}; '),
    ("mistral", '[TOOL_CALLS][{"name": "time", "arguments": {"zone": "UTC"}}, '),
])
def test_a_trailing_separator_waits_while_streaming_and_is_dropped_at_the_end(name, text):
    parser = tool_parser(name)
    partial = parser.parse(text, final=False)
    assert [c.name for c in partial.calls] == ["time", None]  # a next call may still come
    content, calls = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("time", TIME)]


def test_llama3_text_after_a_call_is_content():
    text = '{"name": "time", "parameters": {"zone": "UTC"}} and then some words'
    assert tool_parser("llama3_json").extract(text) == (text, [])
