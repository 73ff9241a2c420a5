"""Chat prompts (chat_template.py): the tools a prompt shows for each tool_choice."""

import pytest
from transformers import AutoTokenizer

from pagefleet.worker.entrypoints.chat_template import ChatTemplate
from pagefleet.worker.entrypoints.protocol import ChatMessage, prompt_tools
from pagefleet.worker.entrypoints.tool_parsers import tool_parser

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
