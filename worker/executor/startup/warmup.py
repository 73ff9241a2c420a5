"""Start-up warm-up of the eager path: every kernel variant its steps need, compiled before any request.

Triton compiles a variant per class of int divisibility and pointer alignment it meets; one compiled
mid-run stalled every running request for 100+ ms on the H200. So the engine runs, once, a prompt chunk,
odd and even token counts, and pure decode and mixed steps at one batch size per decode-attention launch
setting, writing nothing to the cache. The CUDA graphs compile their own variants while they capture.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagefleet.worker.executor.startup.compile_workers import share_of
from pagefleet.worker.executor.step_inputs import CASCADE_MIN_ROWS, eager_metadata, shared_prefix_groups
from pagefleet.worker.models.layers import ops
from pagefleet.worker.models.layers.context import forward_context


def warmup_cases(max_num_seqs: int, num_kv_heads: int, share: tuple[int, int] | None = None,
                 cascade: bool = False) -> list[tuple[int, list[int], bool]]:
    """(decodes, prompt chunk lengths, cascade) of each warm-up step; share (i, n): every n-th case from the i-th
    (a compile worker's slice). cascade: also a decode step whose rows share their first blocks (kernels/cascade.py)."""
    cases = [(0, [8], False), (0, [5, 4], False), (1, [7], False), (3, [8], False)]
    for b in ops.decode_warmup_batches(max_num_seqs, num_kv_heads):
        cases += [(b, [3], False), (b, [], False)]
    if cascade:
        cases.append((CASCADE_MIN_ROWS, [], True))
    return share_of(cases, share)


@torch.inference_mode()
def warm_up(runner, share: tuple[int, int] | None = None) -> int:
    """Run the warm-up steps on the runner's model; -> how many ran."""
    dev = runner.device
    start = time.perf_counter()
    cases = warmup_cases(runner.config.max_num_seqs, runner.kv.data.shape[4], share,  # this rank's KV heads
                         cascade=runner.cascade_samples > 0)
    if not cases:  # more compile workers than cases
        return 0
    for num_decodes, chunks, cascade in cases:
        q_lens = [1] * num_decodes + chunks
        n, total = len(q_lens), sum(q_lens)
        # a cascade step's rows share two whole blocks (every table is zeros) before a token of their own
        seq_lens = np.array([2 * runner.block_size + 1 if cascade else 16] * num_decodes + chunks, dtype=np.int32)
        tables = np.zeros((n, 4), dtype=np.int32)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        slots = torch.full((total,), -1, dtype=torch.long, device=dev)  # writes nothing
        decode_only = not chunks
        # a model with recurrent state runs each warm-up sequence in a slot of its own (zeroed when handed out)
        state_slots = np.arange(n, dtype=np.int32) % runner.state.num_slots if runner.state is not None else None
        groups = shared_prefix_groups(tables, seq_lens, runner.block_size, runner.cascade_samples) if cascade else None
        meta = eager_metadata(dev, slots, tables, seq_lens, cu, 0 if decode_only else num_decodes, decode_only,
                              state_slots, groups)
        with forward_context(meta):
            zeros = torch.zeros(total, dtype=torch.long, device=dev)
            hidden = runner.model(zeros, zeros)
            logits = runner.model.compute_logits(hidden[:1])
    ops.argmax(logits)  # greedy rows, in the model's dtype
    ops.argmax(logits.float())  # penalised rows
    runner.sampler.warm_up(logits)  # sampled rows
    if dev.type == "cuda":
        torch.cuda.synchronize()
    runner.start_seconds["warmup"] = time.perf_counter() - start
    # seconds here are mostly compiles: a filled kernel cache (TRITON_CACHE_DIR) makes them short
    print(f"pagefleet: warmed up {len(cases)} eager step shapes in {runner.start_seconds['warmup']:.1f}s", flush=True)
    return len(cases)
