"""Hermes-style tool calls, as Qwen2.5 / Qwen3 write them: one block per call,
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, content before the first block."""

from __future__ import annotations

import json

from pagefleet.worker.entrypoints.tool_parsers.base import (
    Parsed,
    PartialCall,
    ToolParser,
    hold_back,
    json_content,
    parse_call_object,
    skip_ws,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else hold_back(text, (START,)), [])
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            j = skip_ws(text, pos + len(START))
            if j >= len(text) or text[j] != "{":
                calls.append(PartialCall(None, "", False))  # not started yet, or not a JSON object
                break
            call, end = parse_call_object(text, j, final)
            calls.append(call)
            if end is None or call.name is None:
                break
            close = text.find(END, end)
            if close < 0:
                break  # an unclosed last block still counts once its object is complete
            pos = text.find(START, close + len(END))
        return Parsed(text[:first].rstrip(), calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": json_content(parameters), "end": f"}}\n{END}"}

    def calls_format(self, tags: list[dict], parallel: bool) -> dict:
        if len(tags) == 1 and not parallel:
            return tags[0]
        return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}

    def format_instructions(self) -> str:
        return ("For each function call, return a json object with function name and arguments within "
                f"{START}{END} XML tags:\n{START}\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n' + END)

    def render_calls(self, calls) -> str:
        return "\n".join(f"{START}\n{json.dumps({'name': n, 'arguments': a})}\n{END}" for n, a in calls)
