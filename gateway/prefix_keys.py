"""A request's prompt as blocks the gateway can hash: text chunks, or the model's own tokens.

The gateway's index only has to agree with itself: two requests that share a prefix must share its
leading blocks. Text chunks of `block_size * CHARS_PER_TOKEN` characters do that with no tokenizer;
the model's tokenizer (tokenizer.json and the chat template, from the model's folder) cuts the prompt
exactly where the worker does, so the expected hit is counted in the worker's own blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagefleet.gateway.prefix import text_blocks, token_blocks

# A chunk stands for a block of about this many characters per token. Text varies (SmolLM2's tokenizer:
# 3.0-3.4 on this repository's markdown, 4.8-5.8 on the chat prompts of e2e/bench_prefix_routing.py, 6.4
# on its bare word lists); the estimated hit share depends little on it while prompts are long against a chunk.
CHARS_PER_TOKEN = 4
# The LRU bound of a worker's text chunks assumes text this long per token, so the index remembers at
# least what the worker caches. The two errors cost differently: a prefix the index forgot while the worker
# still holds it sends its next request to any worker, a miss that also copies the prefix onto a second
# worker and evicts what that one held (bounded at 4 chars a token, the index expected 0.39 of the prompt
# tokens of e2e/test_prefix_routing.py's shared system prompts, 5.8 chars a token, to hit where the workers
# hit 0.53, and routed 19 of 48 requests as if nobody held their prompt, 8 being first uses); a prefix the
# index remembers after the worker evicted it sends the request back to that worker, the one miss any
# worker would pay, and the prefix is cached there again.
LONGEST_CHARS_PER_TOKEN = 8


def _flat(content) -> str:
    """Message content as text: OpenAI's list of parts keeps its text parts, in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def prompt_of(messages: list[dict] | None, chat: bool):
    """What the worker will see: chat messages, or (text completion) one prompt, text or token ids.

    LiteLLM hands a text completion's prompt to the strategy as the content of one user message; a
    batch of prompts is routed by its first.
    """
    if not messages:
        return [] if chat else ""
    if chat:
        return [{"role": str(m.get("role", "")), "content": _flat(m.get("content"))} for m in messages]
    prompt = messages[0].get("content")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt if isinstance(prompt, (str, list)) else _flat(prompt)


def canonical_text(prompt) -> str:
    """Chat messages joined role by role; token ids spelled out. Any fixed rendering keeps prefixes."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], dict):
        return "".join(f"\x00{m['role']}\x01{m['content']}" for m in prompt)
    return " ".join(map(str, prompt))


class TextKeys:
    """Text chunks: no tokenizer, no model folder at the gateway."""

    name = "text"

    def blocks(self, messages: list[dict] | None, chat: bool, block_size: int) -> list[bytes]:
        return text_blocks(canonical_text(prompt_of(messages, chat)), block_size * CHARS_PER_TOKEN)

    def capacity(self, num_blocks: int) -> int:
        """The chunks a worker of `num_blocks` KV blocks may hold: its blocks at LONGEST_CHARS_PER_TOKEN."""
        return num_blocks * LONGEST_CHARS_PER_TOKEN // CHARS_PER_TOKEN


class TokenKeys:
    """The model's tokenizer and chat template, loaded once from the model's folder."""

    name = "tokens"

    def __init__(self, folder: str | Path):
        import jinja2.sandbox
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {folder}")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        # The environment transformers renders chat templates in, so the text matches the worker's.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        if self.template is not None:
            try:
                text = self.template.render(messages=prompt, add_generation_prompt=True, **self.special)
            except Exception:  # a template may refuse a role order: the worker answers 400, any key will do
                text = canonical_text(prompt)
        else:
            text = canonical_text(prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def blocks(self, messages: list[dict] | None, chat: bool, block_size: int) -> list[bytes]:
        return token_blocks(self.encode(prompt_of(messages, chat)), block_size)

    def capacity(self, num_blocks: int) -> int:
        """Keys are the worker's own blocks."""
        return num_blocks


def _raise(message: str):
    raise ValueError(message)
