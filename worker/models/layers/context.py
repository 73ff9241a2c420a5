"""The forward context: what every layer of one forward reads (attention metadata, LoRA rows, graph capture).

The model runner and the graph captures enter it around each forward, as nano-vllm sets its context once
per step; `forward_context` restores the previous one on the way out, exceptions included, so a failed step
leaves no stale metadata for the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagefleet.worker.models.layers.lora import LoRAMapping
    from pagefleet.worker.models.layers.paged_attention import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    attention: AttentionMetadata
    lora: LoRAMapping | None = None  # token rows per adapter slot; None: no adapter in this step
    # the forward is being captured into a CUDA graph: linears of a few rows go to our GEMV, whose Triton
    # launch costs the host more than cuBLAS's but nothing once replayed (models/layers/ops.py)
    graphed: bool = False


_current: ForwardContext | None = None


@contextmanager
def forward_context(attention: AttentionMetadata, lora: LoRAMapping | None = None,
                    graphed: bool = False) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attention, lora, graphed)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "a layer ran outside forward_context (the model runner sets it for each step)"
    return _current


def current_lora() -> LoRAMapping | None:
    return None if _current is None else _current.lora


def is_graphed() -> bool:
    """Inside the capture of a CUDA graph (False outside any forward: the eager step's lm_head)."""
    return _current is not None and _current.graphed
