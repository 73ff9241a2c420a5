"""What every kind of step graph shares: one graph per key over static buffers, captured largest first into a pool.

A kind (decode.py, prompt.py, mixed.py) says which keys the settings call for (`for_config`), the memory its graphs
need beyond the KV cache (`reserve_bytes`), whether a step fits one of its graphs (`fits`), how the step's inputs
go into its static buffers (`stage`), and the forward it captures (`_forward`). The graph manager (manager.py)
treats the kinds alike through these.
"""

from __future__ import annotations

import time

import torch

from pagefleet.worker.executor.startup.compile_workers import share_of
from pagefleet.worker.executor.step_inputs import StepInputs
from pagefleet.worker.models.layers import ops


def capture_each(keys, forward, device, share=None, pool=None) -> tuple[dict, object, float]:
    """A CUDA graph of forward(key) for each key, largest first so that the smaller ones reuse its memory,
    all in one memory pool (only one graph runs at a time); each after one run outside the capture, where
    Triton compiles (forward(key, graphed): graphed only inside the capture). share (i, n): only every n-th key
    from the i-th (a compile worker's slice, which wants the kernels compiled, not the graphs).
    -> (graph by key, the pool, seconds taken)."""
    start = time.time()
    ops.reserve_arrivals(device)  # split GEMVs and the attention merge count arrivals in them
    keys = sorted(keys)
    graphs = {}
    for key in reversed(share_of(keys, share)):
        forward(key, False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            forward(key, True)
        pool = graph.pool() if pool is None else pool
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, pool, time.time() - start


class StepGraphs:
    """One kind's graphs by key. Every graph writes its logits into the kind's one static buffer: a replay's
    logits are read by the sampling launches queued behind it, before the next replay on the same stream
    overwrites them."""

    def __init__(self, model, keys: list):
        self.model = model
        self.keys = keys
        self.graphs: dict = {}
        self.pool = None  # the memory pool the graphs are in, shared by every kind (one graph runs at a time)
        self.capture_seconds = 0.0
        self.replays = 0  # steps run as one of these graphs (tests, benchmarks)

    @torch.inference_mode()
    def capture(self, share: tuple[int, int] | None = None, pool=None) -> None:
        """share (i, n): capture only every n-th key from the i-th (a compile worker's slice, which wants the
        kernels compiled, not the graphs; the buffers keep the full sizes so the variants match). pool: the pool
        of the graphs captured before, or None for a new one."""
        self.graphs, self.pool, self.capture_seconds = capture_each(self.keys, self._forward, self.tokens.device,
                                                                    share, pool)
        print(f"pagefleet: captured {self._captured()} in {self.capture_seconds:.1f}s", flush=True)

    def replay(self, key, step: StepInputs) -> torch.Tensor:
        """Run the staged step; -> the logits of its rows that sample (zero rows when none do), read from the
        static buffer, which the next replay overwrites."""
        self.graphs[key].replay()
        self.replays += 1
        return self._sampled_logits(step)

    def _sampled_logits(self, step: StepInputs) -> torch.Tensor:
        """The lm_head ran inside the graph on the rows that sample, into the first rows of the buffer."""
        return self.logits[: len(step.logits_rows)]
