"""Chat prompts: a request's messages and tools through the tokenizer's chat template, as text and token ids.

Templates that know tools get them as apply_chat_template(tools=...); others get them as a system message in the
tool parser's format, and earlier calls written into the assistant turns.
"""

from __future__ import annotations

import json

from pagefleet.worker.entrypoints.protocol import APIError, message_dicts


class ChatTemplate:
    """The tokenizer's chat template, with the tool parser's format for the templates that lack tools."""

    def __init__(self, tokenizer, tool_parser):
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        template = tokenizer.chat_template
        template = json.dumps(template) if not isinstance(template, str) else template
        self.renders_tools = "tools" in template
        self.renders_calls = "tool_calls" in template

    def render(self, messages, add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The chat prompt as text and token ids, tools rendered as the template (or the parser) writes them."""
        dicts, kwargs = self._inputs(messages, tools)
        text = self._apply(dicts, add_generation_prompt, kwargs)
        # The template already holds the special tokens (as LLM.chat does).
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def generation_prompt(self, messages, tools: list[dict] | None, text: str) -> str:
        """What the template adds for the reply (text is the prompt rendered with it): the prompt past the same
        messages rendered without it, or the whole prompt where the two do not line up."""
        dicts, kwargs = self._inputs(messages, tools)
        head = self._apply(dicts, False, kwargs)
        return text[len(head):] if text.startswith(head) else text

    def _inputs(self, messages, tools: list[dict] | None) -> tuple[list[dict], dict]:
        if not messages:
            raise APIError(400, "messages must not be empty.", param="messages")
        dicts = message_dicts(messages)
        kwargs = {}
        if not self.renders_calls:
            dicts = [self._calls_as_text(d) for d in dicts]
        if tools:
            if self.renders_tools:
                kwargs["tools"] = tools
            else:
                dicts = self._tools_as_system(dicts, tools)
        return dicts, kwargs

    def _apply(self, dicts: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.tokenizer.apply_chat_template(dicts, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except APIError:
            raise
        except Exception as e:  # a template may reject role orders etc. with any exception type
            raise APIError(400, f"The chat template rejected the messages: {e}", param="messages") from None

    def _calls_as_text(self, d: dict) -> dict:
        if not d.get("tool_calls"):
            return d
        calls = self.tool_parser.render_calls([(c["function"]["name"], c["function"]["arguments"])
                                               for c in d["tool_calls"]])
        rest = {k: v for k, v in d.items() if k != "tool_calls"}
        return {**rest, "content": (d["content"] + "\n" if d["content"] else "") + calls}

    def _tools_as_system(self, dicts: list[dict], tools: list[dict]) -> list[dict]:
        described = "\n".join(json.dumps(t["function"]) for t in tools)
        text = (f"You can call these functions:\n{described}\n\n" + self.tool_parser.format_instructions())
        if dicts and dicts[0]["role"] in ("system", "developer"):
            return [{**dicts[0], "content": dicts[0]["content"] + "\n\n" + text}] + dicts[1:]
        return [{"role": "system", "content": text}] + dicts
