"""Tool-call parsers by format name (vLLM's `--tool-call-parser` names), and the default for a model type."""

from __future__ import annotations

from pagefleet.worker.entrypoints.tool_parsers.base import ToolCall, ToolParser, ToolStreamer
from pagefleet.worker.entrypoints.tool_parsers.hermes import HermesToolParser
from pagefleet.worker.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser
from pagefleet.worker.entrypoints.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def default_parser_name(model_type: str | None) -> str:
    """The format a model family is trained on; hermes (Qwen's) for families without one of their own."""
    t = (model_type or "").lower()
    if t.startswith("llama"):
        return "llama3_json"
    if t.startswith(("mistral", "mixtral", "ministral")):
        return "mistral"
    return "hermes"


def tool_parser(name: str | None, model_type: str | None = None) -> ToolParser:
    name = name or default_parser_name(model_type)
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "ToolStreamer", "default_parser_name", "tool_parser"]
