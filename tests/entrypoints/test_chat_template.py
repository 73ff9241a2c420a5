"""Chat prompts (chat_template.py): the tools a prompt shows for each tool_choice, where the reply's own part of
the prompt stands in a think block (whether a reasoning model's constraint waits for `</think>`), the template's
own switches (chat_template_kwargs) and continuing the final message."""

import pytest
from transformers import AutoTokenizer

from pagefleet.worker.entrypoints.chat_template import ChatTemplate, template_variables
from pagefleet.worker.entrypoints.protocol import APIError, ChatMessage, prompt_tools
from pagefleet.worker.entrypoints.reasoning import reasoning_ended, think_token_ids
from pagefleet.worker.entrypoints.tool_parsers import tool_parser
from think_models import think_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
# a template that knows tools, as Qwen's and Llama's do: they arrive as apply_chat_template(tools=...)
TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n"
                  "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def msgs(*pairs):
    return [ChatMessage(role=role, content=content) for role, content in pairs]


@pytest.fixture(scope="module")
def bundled(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_tool_choice_none_shows_the_tools_unless_the_server_excludes_them():
    assert prompt_tools(TOOLS, "none", exclude_when_none=False) == TOOLS
    assert prompt_tools(TOOLS, "none", exclude_when_none=True) is None
    for mode in ("auto", "required", "named"):
        assert prompt_tools(TOOLS, mode, exclude_when_none=True) == TOOLS
    assert prompt_tools([], "none", exclude_when_none=False) is None


@pytest.mark.parametrize("native", [False, True])
def test_shown_tools_are_in_the_prompt_and_excluded_ones_are_not(bundled, native):
    """A template without tools gets them as a system message in the parser's format; one with tools gets
    them through its own markup."""
    tokenizer = AutoTokenizer.from_pretrained(bundled.name_or_path)
    if native:
        tokenizer.chat_template = TOOLS_TEMPLATE
    template = ChatTemplate(tokenizer, tool_parser("hermes", None))
    assert template.renders_tools is native
    messages = msgs(("user", "Weather in Rome?"))
    shown, shown_ids = template.render(messages, tools=prompt_tools(TOOLS, "none", exclude_when_none=False))
    hidden, hidden_ids = template.render(messages, tools=prompt_tools(TOOLS, "none", exclude_when_none=True))
    assert "get_weather" in shown and "get_weather" not in hidden
    assert len(shown_ids) > len(hidden_ids) and hidden == template.render(messages)[0]
    assert ("<tools>get_weather;</tools>" in shown) is native
    assert ("<tool_call>" in shown) is not native  # the hermes format's instructions


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    tokenizer = think_tokenizer(tmp_path_factory.mktemp("think-tokenizer"))
    start, end = think_token_ids(tokenizer)
    return tokenizer, ChatTemplate(tokenizer, tool_parser("hermes", None)), start, end


def test_think_markers_are_found_only_as_single_tokens(bundled, think):
    tokenizer, _, start, end = think
    assert (start, end) == tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    assert think_token_ids(bundled) == (None, None)  # SmolLM2 spells </think> in pieces: no gate


def test_reasoning_ended_reads_the_marker_nearest_the_end():
    start, end = 10, 11
    assert reasoning_ended([1, start, 2, end, 3], start, end)
    assert not reasoning_ended([1, start, 2, end, 3, start, 4], start, end)
    assert not reasoning_ended([1, 2, 3], start, end)  # no block yet: the model may open one
    assert reasoning_ended([1, end], None, end)


@pytest.mark.parametrize("messages, ended", [
    (msgs(("user", "Describe a cat.")), False),  # Qwen3 thinking: the model opens its own block
    (msgs(("user", "Describe a cat. /think")), False),  # the template opened it
    (msgs(("user", "Describe a cat. /no_think")), True),  # the template closed an empty block already
    # an earlier turn's closed block is history: the reply's own prompt decides
    (msgs(("user", "Hi."), ("assistant", "<think>greet</think>Hello."), ("user", "Describe a cat.")), False),
    (msgs(("user", "Hi."), ("assistant", "<think>greet</think>Hello."), ("user", "A cat. /no_think")), True),
])
def test_the_replys_own_prompt_decides_whether_reasoning_ended(think, messages, ended):
    tokenizer, template, start, end = think
    text, ids = template.render(messages)
    reply = template.generation_prompt(messages, None, text)
    assert text.endswith(reply) and reply.startswith("<|im_start|>assistant\n")
    assert reasoning_ended(tokenizer.encode(reply, add_special_tokens=False), start, end) is ended
    if len(messages) > 1 and not ended:  # (the reply's prompt has no marker here)
        assert reasoning_ended(ids, start, end)  # the whole prompt would have said ended


def test_template_variables_are_the_switches_a_template_reads(bundled, think):
    assert template_variables(think[0].chat_template) == {"enable_thinking"}
    assert template_variables(bundled.chat_template) == set()  # messages and add_generation_prompt are ours
    named = {"default": TOOLS_TEMPLATE, "other": "{{ messages[0]['content'] }}{% if flag %}!{% endif %}"}
    assert template_variables(named) == {"flag"}  # a dict of named templates: every one's
    assert template_variables("{% generation %}{{ x }}{% endgeneration %}") == {"x"}  # transformers' own tag
    assert template_variables(None) == set()  # no template at all: the rendering refuses the request


def test_chat_template_kwargs_reach_the_template_and_unknown_ones_are_refused(think):
    tokenizer, template, start, end = think
    messages = msgs(("user", "Describe a cat."))
    thinking, _ = template.render(messages)
    text, ids = template.render(messages, template_kwargs={"enable_thinking": False})
    assert text == template.render(msgs(("user", "Describe a cat. /no_think")))[0].replace(" /no_think", "")
    assert text.endswith("<think>\n\n</think>\n\n") and not thinking.endswith("</think>\n\n")
    assert template.render(messages, template_kwargs={"enable_thinking": True})[0] == thinking
    reply = template.generation_prompt(messages, None, text, template_kwargs={"enable_thinking": False})
    assert reasoning_ended(tokenizer.encode(reply, add_special_tokens=False), start, end)
    for bad, says in (({"enable_thinkng": False}, "does not read 'enable_thinkng' (it reads enable_thinking)"),
                      ({"tools": []}, "set by the request itself"),
                      ({"add_generation_prompt": False}, "set by the request itself")):
        with pytest.raises(APIError) as e:
            template.render(messages, template_kwargs=bad)
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
        assert f"chat_template_kwargs.{next(iter(bad))}" in str(e.value.body()) and says in str(e.value.body())


def test_a_template_not_parsed_here_lets_the_kwargs_through(think):
    template = ChatTemplate(think[0], tool_parser("hermes", None))
    template.variables = None  # as template_variables leaves it for a template this parse misreads
    text, _ = template.render(msgs(("user", "Hi")), template_kwargs={"enable_thinking": False, "other": 1})
    assert text.endswith("</think>\n\n")


def test_continue_final_message_leaves_the_last_turn_open(think):
    tokenizer, template, start, end = think
    messages = msgs(("user", "Describe a cat."), ("assistant", "<think>fur</think>The cat is"))
    text, ids = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    closed, _ = template.render(messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<think>fur</think>The cat is")
    assert closed.startswith(text) and closed[len(text):] == "<|im_end|>\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    # the reply's own prompt is the open turn: its think block is closed, so a constraint would hold at once
    reply = template.generation_prompt(messages, None, text, continue_final_message=True)
    assert reply == "<|im_start|>assistant\n<think>fur</think>The cat is"
    assert reasoning_ended(tokenizer.encode(reply, add_special_tokens=False), start, end)
    with pytest.raises(APIError) as e:  # the generation prompt is on unless the request turns it off
        template.render(messages, continue_final_message=True)
    assert e.value.status == 400 and e.value.param == "continue_final_message"
