"""What every tool-call format shares: the call in the OpenAI shape, a scanner for JSON text that is still
arriving, and the streamer that turns a growing text into OpenAI `tool_calls` deltas.

A format parses the whole text seen so far into content and (possibly partial) calls; the streamer sends
what grew since the last parse. Streaming and non-streaming therefore read the same text the same way, and a
streamed call's deltas add up to the call a non-streamed request returns.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text as the model wrote it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    name: str | None  # None until the name is known
    arguments: str  # the arguments' JSON text known so far
    complete: bool


@dataclass
class Parsed:
    content: str  # only grows while text is appended (held-back text is released later, never taken back)
    calls: list[PartialCall]


WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def scan_value(text: str, i: int, final: bool = False) -> int | None:
    """Index just past the JSON value that starts at text[i] (after whitespace); None while it is incomplete.
    Only the value's extent is found here (strings, escapes, nesting); json.loads judges it later."""
    n = len(text)
    i = skip_ws(text, i)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < n:
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 2
                    continue
                if ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null ends at a delimiter
    while j < n and text[j] not in ",}]" + WS:
        j += 1
    return j if j < n or final else None


# The call object as models write it: the name first, then its arguments (Llama names them "parameters").
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def parse_call_object(text: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
    """The call object that starts at text[i] ('{'): the call known so far and the index past the object
    (None while it is incomplete). Name-first objects stream their arguments as they arrive; other key orders
    are read once the object is complete."""
    end = scan_value(text, i, final)
    m = _HEAD.match(text, i)
    if m:
        name = json.loads(f'"{m.group(1)}"')
        a = m.end()
        a_end = scan_value(text, a, final)
        if a_end is None:
            return PartialCall(name, text[a:], False), None
        return PartialCall(name, text[a:a_end], end is not None), end
    if end is None:
        return PartialCall(None, "", False), None
    try:
        obj = json.loads(text[i:end])
    except ValueError:
        return PartialCall(None, "", False), end
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(name, str) or args is None:
        return PartialCall(None, "", False), end
    return PartialCall(name, args if isinstance(args, str) else json.dumps(args), True), end


def parse_call_list(text: str, i: int, final: bool, separator: str, strict: bool) -> list[PartialCall]:
    """Call objects from text[i] on, `separator` between them (Llama's `;`, Mistral's `,`). strict: text other
    than a separator after a call means the reply is not in this format (an unnamed call, so it stays content);
    otherwise it ends the list (Mistral's `]`)."""
    calls: list[PartialCall] = []
    while True:
        if i >= len(text) or text[i] != "{":
            calls.append(PartialCall(None, "", False))  # not started yet, or not a call object
            break
        call, end = parse_call_object(text, i, final)
        calls.append(call)
        if end is None or call.name is None:
            break
        i = skip_ws(text, end)
        if i >= len(text):
            break
        if text[i] != separator:
            if strict:
                calls.append(PartialCall(None, "", False))
            break
        i = skip_ws(text, i + 1)
        if final and i >= len(text):
            break  # a finished reply's trailing separator: no call follows
    return calls


def hold_back(text: str, markers: tuple[str, ...]) -> str:
    """Text safe to send while more may come: without a tail that could start a marker, and without trailing
    whitespace (dropped before a tool call, released otherwise)."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut].rstrip()


class ToolParser:
    """One model family's tool-call format: parse, stream, constrain (xgrammar structural tags) and describe."""

    name = ""
    skip_special_tokens = True  # False where the format's marker is a special token

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def call_tag(self, name: str, parameters: dict) -> dict:
        """The structural-tag element that is one call of this function, its arguments held to the schema."""
        raise NotImplementedError

    def calls_format(self, tags: list[dict], parallel: bool) -> dict:
        """One or more calls (only one unless parallel) and nothing else."""
        raise NotImplementedError

    def format_instructions(self) -> str:
        """How to write a call, for templates that do not render tools themselves."""
        raise NotImplementedError

    def render_calls(self, calls: list[tuple[str, dict | str]]) -> str:
        """An assistant turn's calls as this format writes them, for templates that do not render tool_calls."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished text as (content, calls). A call that is cut off or whose arguments are not a JSON object
        leaves the whole text as content, with no calls."""
        p = self.parse(text, final=True)
        if not p.calls:
            return text, []
        calls = []
        for c in p.calls:
            if not c.complete or not c.name:
                return text, []
            try:
                if not isinstance(json.loads(c.arguments), dict):
                    return text, []
            except ValueError:
                return text, []
            calls.append(ToolCall(c.name, c.arguments))
        return p.content or None, calls

    def constraint(self, tools: list[dict], named: str | None, parallel: bool = True) -> dict:
        """An xgrammar structural tag that forces this format: a call of `named`, or (tool_choice "required")
        one or more calls of any of the tools, arguments valid for the function's parameters schema."""
        fns = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
        tags = [self.call_tag(f["name"], f["parameters"]) for f in fns]
        return {"type": "structural_tag", "format": self.calls_format(tags, parallel and named is None)}

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


def json_content(parameters: dict) -> dict:
    # Bounded runs of whitespace: a small model otherwise can fill its budget with newlines inside the JSON.
    return {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 24}


class ToolStreamer:
    """One choice's stream: text deltas in, (content delta, OpenAI tool_calls delta items) out."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent: list[list] = []  # per call: [id, arguments characters sent]

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        p = self.parser.parse(self.text, final)
        content = p.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(p.content))
        items = []
        for i, call in enumerate(p.calls):
            if call.name is None:
                break  # calls stream in order; a later one waits for this one's name
            if i == len(self.sent):
                self.sent.append([new_call_id(), 0])
                items.append({"index": i, "id": self.sent[i][0], "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
            args = call.arguments[self.sent[i][1]:]
            if args:
                self.sent[i][1] = len(call.arguments)
                if items and items[-1]["index"] == i:
                    items[-1]["function"]["arguments"] += args
                else:
                    items.append({"index": i, "function": {"arguments": args}})
        return content, items

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)
