"""Chat prompts: a request's messages and tools through the tokenizer's chat template, as text and token ids.

Templates that know tools get them as apply_chat_template(tools=...); others get them as a system message in the
tool parser's format, and earlier calls written into the assistant turns. A request's chat_template_kwargs (vLLM's
field: Qwen3's `enable_thinking`) reach the template when it reads them; a name it never reads is a 400, so a
misspelt switch is not silently dropped. The server's --chat-template is used in place of the tokenizer's
template; a request's own chat_template (vLLM's field) is used only where the server trusts request templates
(--trust-request-chat-template, as in vLLM): a template is a program the server runs for the caller.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging

from pagefleet.worker.entrypoints.protocol import APIError, message_dicts

log = logging.getLogger(__name__)


class ChatTemplate:
    """The tokenizer's chat template, with the tool parser's format for the templates that lack tools."""

    def __init__(self, tokenizer, tool_parser, template: str | None = None):
        """template: a Jinja chat template used in place of the tokenizer's (the server's --chat-template, or a
        request's chat_template); it is compiled here, so one that does not parse is a 400 naming chat_template."""
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.template = template  # None: the tokenizer's
        if template is not None and (error := template_error(template)) is not None:
            raise APIError(400, f"chat_template is not a valid Jinja template: {error}", param="chat_template")
        source = tokenizer.chat_template if template is None else template
        text = json.dumps(source) if not isinstance(source, str) else source
        self.renders_tools = "tools" in text
        self.renders_calls = "tool_calls" in text
        self.renders_documents = "documents" in text
        self.variables = template_variables(source)

    def render(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               continue_final_message: bool = False, template_kwargs: dict | None = None,
               documents: list[dict] | None = None) -> tuple[str, list[int]]:
        """The chat prompt as text and token ids (render_text, then encoded)."""
        text = self.render_text(messages, add_generation_prompt, tools, continue_final_message, template_kwargs,
                                documents)
        return text, self.tokenizer.encode(text, add_special_tokens=False)  # the template holds the special tokens

    def render_text(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    documents: list[dict] | None = None) -> str:
        """The chat prompt as text, tools rendered as the template (or the parser) writes them; encode it without
        special tokens (the template holds them, as LLM.chat does). continue_final_message: the last message is left
        open for the model to go on with (no end of turn), as in transformers and vLLM; it excludes
        add_generation_prompt. documents: vLLM's retrieval documents, for a template that reads `documents`
        (Command R's, Granite's); a template that does not is a 400, since they would be dropped."""
        refused = prompt_options_error(self.variables, add_generation_prompt, continue_final_message, template_kwargs)
        if refused is not None:
            raise APIError(400, refused[1], param=refused[0])
        if documents and not self.renders_documents:
            raise APIError(400, "documents: the chat template does not read documents, so they would not reach the "
                           "model.", param="documents")
        dicts, kwargs = self._inputs(messages, tools, template_kwargs, documents)
        return self._apply(dicts, add_generation_prompt, kwargs, continue_final_message)

    def generation_prompt(self, messages, tools: list[dict] | None, text: str, continue_final_message: bool = False,
                          template_kwargs: dict | None = None, documents: list[dict] | None = None) -> str:
        """What the prompt holds of the reply (text is the prompt as rendered for it): what the template adds for
        it, the prompt past the same messages rendered without it; with continue_final_message, the prompt past
        the messages before the final one. The whole prompt where the two do not line up."""
        if continue_final_message:
            if len(messages) < 2:
                return text
            messages = messages[:-1]
        dicts, kwargs = self._inputs(messages, tools, template_kwargs, documents)
        head = self._apply(dicts, False, kwargs)
        return text[len(head):] if text.startswith(head) else text

    def _inputs(self, messages, tools: list[dict] | None, template_kwargs: dict | None = None,
                documents: list[dict] | None = None) -> tuple[list[dict], dict]:
        """The messages as the template takes them and its keyword arguments (template_kwargs checked by render)."""
        if not messages:
            raise APIError(400, "messages must not be empty.", param="messages")
        dicts = message_dicts(messages)
        kwargs = dict(template_kwargs or {})
        if documents:
            kwargs["documents"] = documents
        if not self.renders_calls:
            dicts = [self._calls_as_text(d) for d in dicts]
        if tools:
            if self.renders_tools:
                kwargs["tools"] = tools
            else:
                dicts = self._tools_as_system(dicts, tools)
        return dicts, kwargs

    def _apply(self, dicts: list[dict], add_generation_prompt: bool, kwargs: dict,
               continue_final_message: bool = False) -> str:
        try:
            if self.template is not None:
                kwargs = {**kwargs, "chat_template": self.template}
            return self.tokenizer.apply_chat_template(dicts, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **kwargs)
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


def load_chat_template(value: str) -> str:
    """--chat-template's value as a template: a file's text, or the value itself where it is a template written
    inline (it holds Jinja's braces), as vLLM reads that flag. ValueError for a path that is not a file or a
    template that does not parse."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    if (error := template_error(template)) is not None:
        raise ValueError(f"--chat-template {value!r} is not a valid Jinja template: {error}")
    return template


def template_error(template: str) -> str | None:
    """Why transformers cannot compile the template, or None when it can."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except Exception as e:  # jinja2's TemplateSyntaxError, or whatever a broken template raises
        return str(e)
    return None


def prompt_options_error(variables: frozenset[str] | None, add_generation_prompt: bool,
                         continue_final_message: bool, template_kwargs: dict | None) -> tuple[str, str] | None:
    """Why a chat prompt cannot be rendered with these options, as (the field, the message), or None. variables:
    template_variables of the template (None: unknown, any keyword passes). Shared by the server (a 400) and
    LLM.chat (a ValueError), so neither drops a switch the template never reads."""
    if continue_final_message and add_generation_prompt:
        return ("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt to false to continue the final message.")
    for name in template_kwargs or {}:
        where = f"chat_template_kwargs.{name}"
        if name in reserved_kwargs():
            return "chat_template_kwargs", f"{where} is set by the request itself, not through chat_template_kwargs."
        if variables is not None and name not in variables:
            reads = f" (it reads {', '.join(sorted(variables))})" if variables else ""
            return "chat_template_kwargs", f"{where}: the model's chat template does not read {name!r}{reads}."
    return None


@functools.cache
def reserved_kwargs() -> frozenset[str]:
    """apply_chat_template's own parameters (and the messages): what the request's other fields set. Read on first
    use: importing transformers here would import torch before the server has started its compile workers."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    return frozenset(named | {"messages"})


def template_variables(template) -> frozenset[str] | None:
    """The names a chat template (or each of a dict of named templates) reads from its caller, less the reserved
    ones and the globals transformers gives every template (raise_exception, strftime_now ...); None where the
    template cannot be parsed here, and then any name is let through."""
    import jinja2.meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if template is None:  # no chat template: every chat request is refused by the rendering itself
        return frozenset()
    sources = list(template.values()) if isinstance(template, dict) else [template]
    names: set[str] = set()
    try:
        for source in sources:
            env = _compile_jinja_template(source).environment  # transformers' environment: its tags parse
            names |= jinja2.meta.find_undeclared_variables(env.parse(source)) - set(env.globals)
    except Exception as e:  # a template transformers renders but this parse misreads: keep requests working
        log.warning("chat template variables unknown (%s): chat_template_kwargs are passed through unchecked", e)
        return None
    return frozenset(names - reserved_kwargs())
