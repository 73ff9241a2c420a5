"""Mistral tool calls: `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}, ...]`, or (newer
tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call; content before the first marker."""

from __future__ import annotations

import json
import re

from pagefleet.worker.entrypoints.tool_parsers.base import (
    Parsed,
    PartialCall,
    ToolParser,
    hold_back,
    json_content,
    parse_call_list,
    scan_value,
    skip_ws,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[ARGS\])?\s*(?=\{)")


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token of Mistral's tokenizers

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(BOT)
        if first < 0:
            return Parsed(text if final else hold_back(text, (BOT,)), [])
        content = text[:first].rstrip()
        i = skip_ws(text, first + len(BOT))
        if i >= len(text):
            return Parsed(content, [PartialCall(None, "", False)])
        if text[i] in "[{":
            return Parsed(content, self._list(text, i, final))
        return Parsed(content, self._named(text, first, final))

    def _list(self, text: str, i: int, final: bool) -> list[PartialCall]:
        if text[i] == "[":
            i = skip_ws(text, i + 1)
        return parse_call_list(text, i, final, ",", strict=False)

    def _named(self, text: str, pos: int, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        while pos >= 0:
            m = _NAMED.match(text, pos + len(BOT))
            if m is None:
                calls.append(PartialCall(None, "", False))
                break
            a = m.end()
            end = scan_value(text, a, final)
            calls.append(PartialCall(m.group(1), text[a:end] if end else text[a:], end is not None))
            if end is None:
                break
            pos = text.find(BOT, end)
        return calls

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": json_content(parameters), "end": "}"}

    def calls_format(self, tags: list[dict], parallel: bool) -> dict:
        inner = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel}
        return {"type": "sequence", "elements": [{"type": "const_string", "value": BOT + "["}, inner,
                                                 {"type": "const_string", "value": "]"}]}

    def format_instructions(self) -> str:
        return (f"To call functions, respond only with {BOT} followed by a JSON list of calls: "
                f'{BOT}[{{"name": <function-name>, "arguments": <args-json-object>}}]')

    def render_calls(self, calls) -> str:
        return BOT + json.dumps([{"name": n, "arguments": a} for n, a in calls])
