"""The step's CUDA graphs: the decode, prompt and mixed kinds in one memory pool, and which one a step replays.

Bring-up captures the kinds these settings call for (decode first, each kind largest step first), all into the
pool the first capture makes: only one graph runs at a time. A step then replays the one graph its shape fits,
or runs eagerly: steps past the largest graph, LoRA steps (the graphs hold no adapter) and every step under
`--enforce-eager` or on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from pagefleet.worker.executor.graphs.decode import DecodeGraphs
from pagefleet.worker.executor.graphs.mixed import MixedGraphs
from pagefleet.worker.executor.graphs.prompt import PromptGraphs
from pagefleet.worker.executor.state_cache import is_stateful
from pagefleet.worker.executor.step_inputs import StepInputs

KINDS = (("decode", DecodeGraphs), ("prompt", PromptGraphs), ("mixed", MixedGraphs))  # in capture order
GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graph pool and workspace, kept out of the KV budget so capture cannot OOM


def reserve_bytes(config, vocab_size: int, dtype: torch.dtype, activation_peak: int) -> int:
    """Memory the graphs need beyond the KV cache, for its budget to leave free (0 under --enforce-eager).
    activation_peak: the profiled largest step's activations, which each kind's reserve scales."""
    if config.enforce_eager:
        return 0
    kinds = sum(kind.reserve_bytes(config, vocab_size, dtype, activation_peak) for _, kind in KINDS)
    return GRAPH_RESERVE_BYTES + kinds


class CUDAGraphs:
    """Each kind's graphs, None where a kind is off (tests and benchmarks switch one off by setting it to None)."""

    def __init__(self):
        self.decode: DecodeGraphs | None = None
        self.prompt: PromptGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self.capture_seconds = 0.0

    def capture(self, model, device: torch.device, config, max_model_len: int, max_blocks_per_seq: int,
                share: tuple[int, int] | None = None) -> None:
        """Build and capture every kind these settings call for. share (i, n): a compile worker's slice of each
        kind's graphs."""
        pool = None
        if is_stateful(model) and not getattr(model, "state_graphs", False):
            # every kind stages the step's state slots, but the model's recurrent-state ops must be capturable
            # (no host syncs) for a graph to replay them: until the model says so (state_graphs), steps run eagerly
            print("pagefleet: no CUDA graphs: this model's recurrent-state kernels cannot be captured yet", flush=True)
            return
        for name, cls in KINDS:
            kind = cls.for_config(model, device, config, max_model_len, max_blocks_per_seq)
            if kind is not None:
                kind.capture(share, pool)
                pool = kind.pool if pool is None else pool
                self.capture_seconds += kind.capture_seconds
            setattr(self, name, kind)

    def _kind_for(self, step: StepInputs):
        """The captured kind whose graphs run this step, or None (the step runs eagerly)."""
        return next((kind for kind in (self.decode, self.prompt, self.mixed) if kind is not None and kind.fits(step)),
                    None)

    def fits(self, step: StepInputs) -> bool:
        """Whether a captured graph runs this step (replay would not return None)."""
        return self._kind_for(step) is not None

    def replay(self, step: StepInputs, feed: tuple[np.ndarray, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Replay the graph the step fits: -> the logits of its rows that sample (zero rows when none do). None:
        no graph fits, the step runs eagerly. feed: tokens still on the device (step_inputs.feed_device_tokens)."""
        kind = self._kind_for(step)
        return kind.replay(kind.stage(step, feed), step) if kind is not None else None
