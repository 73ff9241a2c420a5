"""Llama 3.x JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several calls separated by `;`; a reply that does not start with one is content."""

from __future__ import annotations

import json

from pagefleet.worker.entrypoints.tool_parsers.base import (
    Parsed,
    ToolParser,
    json_content,
    parse_call_list,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        s = skip_ws(text, 0)
        rest = text[s:]
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, s + len(PYTHON_TAG))
        elif rest.startswith("{"):
            i = s
        elif not final and PYTHON_TAG.startswith(rest):  # nothing decided yet: whitespace or the tag's start
            return Parsed("", [])
        else:
            return Parsed(text if final else text.rstrip(), [])
        calls = parse_call_list(text, i, final, ";", strict=True)
        return Parsed("", calls)

    def call_tag(self, name: str, parameters: dict) -> dict:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                "content": json_content(parameters), "end": "}"}

    def calls_format(self, tags: list[dict], parallel: bool) -> dict:
        if len(tags) == 1 and not parallel:
            return tags[0]
        return {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True,
                "stop_after_first": not parallel}

    def format_instructions(self) -> str:
        return ("To call a function, respond only with a JSON object of the form "
                '{"name": <function-name>, "parameters": <args-json-object>}; separate several calls with "; ".')

    def render_calls(self, calls) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
