"""Reasoning parsers (`--reasoning-parser`): a reply's `<think>...</think>` part becomes `reasoning_content`,
the rest `content`, for a finished text and for a stream of text deltas.

qwen3 and deepseek_r1 read the same way: the reasoning is the block at the start of the reply, opened either by
the model or already by the prompt (templates that end the prompt with `<think>`, as DeepSeek-R1's and Qwen3's
thinking variants do). Which of the two holds is read off the prompt's tail, so a reply without `</think>` is
reasoning cut short when the prompt opened the block and plain content when it did not.

A structured request's grammar waits for the reasoning (engine/structured_output.py's AfterReasoning): here are
the marker token ids it waits on and the check of whether a prompt already closed its block.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def think_token_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of `<think>` and `</think>` where each is one token of the vocabulary (None where it is not)."""
    def one(marker: str) -> int | None:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == marker else None

    return one(START), one(END)


def reasoning_ended(prompt_ids: list[int], start_id: int | None, end_id: int) -> bool:
    """Whether the prompt already closed its think block (its last `</think>` after its last `<think>`), as a
    non-thinking chat template does with `<think>\n\n</think>\n\n`: the reply then starts past the reasoning."""
    for t in reversed(prompt_ids):  # the marker nearest the end decides
        if t == end_id:
            return True
        if t == start_id:
            return False
    return False


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt leaves a `<think>` block open, so that the reply starts inside it."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def _held(text: str, marker: str) -> str:
    """text without a tail that could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def split_reasoning(text: str, in_reasoning: bool, final: bool = True) -> tuple[str | None, str]:
    """(reasoning, content) of the reply so far; while not final, a tail that may still become a marker waits.
    Both parts only grow as text is appended, so a stream sends their differences."""
    body = text.lstrip()
    if body.startswith(START):
        body, in_reasoning = body[len(START):], True
    elif not final and START.startswith(body):
        return None, ""  # might be the opening tag
    if not in_reasoning:
        return None, text
    body = body.lstrip()
    end = body.find(END)
    if end < 0:
        return (body if final else _held(body, END)), ""
    return body[:end], body[end + len(END):].lstrip()


class ReasoningStreamer:
    """One choice's stream: text deltas in, (reasoning delta, content delta) out."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.text = ""
        self.sent = [0, 0]

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = split_reasoning(self.text, self.in_reasoning, final)
        reasoning = reasoning or ""
        out = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = [max(self.sent[0], len(reasoning)), max(self.sent[1], len(content))]
        return out

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
