"""KV cache sizing: profile the largest step, then give the KV cache what the memory budget leaves.

A model with recurrent layers has its state slots allocated before this (executor/state_cache.py): on a GPU the
profiled peak holds them, on CPU they come out of the byte budget, so either way the KV cache gets what is left.
"""

from __future__ import annotations

import torch

from pagefleet.worker.executor.graphs.manager import reserve_bytes
from pagefleet.worker.executor.kv_cache import block_bytes
from pagefleet.worker.executor.sampling_state import penalty_slot_bytes
from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.models.registry import ModelConfig

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GiB


@torch.inference_mode()
def profile_peak_bytes(runner, config) -> int:
    """Run the largest step the scheduler can build (no cache yet) and the sampler on a full batch."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tokens = config.max_num_batched_tokens
    lens = []
    while tokens > 0:
        lens.append(min(tokens, runner.max_model_len))
        tokens -= lens[-1]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    dev = runner.device
    state_slots = None
    if runner.state is not None:  # each profiled sequence runs in a slot of its own, as a step's do
        state_slots = torch.arange(len(lens), dtype=torch.int32, device=dev) % runner.state.num_slots
    meta = AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.long, device=dev),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        max_seq_len=max(lens),
        is_decode=False,
        state_slots=state_slots,
    )
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    with forward_context(meta):
        hidden = runner.model(torch.zeros(cu[-1], dtype=torch.long, device=dev), positions)
    rows = min(config.max_num_seqs, cu[-1])
    logits = runner.model.compute_logits(hidden[:rows])
    # more than the sampler's temporaries take (an fp32 copy of the penalised rows, the logprobs rows' log-softmax;
    # it sorts nothing): a sort of a full batch of rows, as the sampler before it did, keeps that margin
    logits.float().sort(dim=-1, descending=True)[0].softmax(-1).cumsum(-1)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def size_kv_cache(runner, config, mc: ModelConfig) -> int:
    """Number of KV blocks: forced, from the CPU byte budget, or what the GPU fraction leaves after profiling
    and what is allocated after it: the CUDA graphs and the sampler's penalty slots. mc: this rank's model
    config (its share of the KV heads)."""
    per_block = block_bytes(mc, config.block_size, runner.kv_dtype, len(runner.model.attention_layers()))
    per_seq_blocks = runner.max_blocks_per_seq
    state_bytes = runner.state.nbytes if runner.state is not None else 0
    if config.num_gpu_blocks_override:
        num_blocks = config.num_gpu_blocks_override
        available = num_blocks * per_block
    elif runner.device.type != "cuda":
        available = (config.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES) - state_bytes
        # more blocks than every sequence at full length can use is wasted host memory
        num_blocks = min(max(available, 0) // per_block, config.max_num_seqs * per_seq_blocks + 1)
    else:
        # sleep mode: the weights are mapped outside torch's caching allocator (executor/sleep.py)
        outside = runner.sleep_mode.mapped_bytes() if getattr(runner, "sleep_mode", None) is not None else 0
        weights = torch.cuda.memory_allocated() + outside  # the model, before the profiled step's activations
        peak = profile_peak_bytes(runner, config) + outside
        free, total = torch.cuda.mem_get_info()
        vocab = runner.model_config.vocab_size  # the logits rows are whole on every tensor-parallel rank
        reserve = (reserve_bytes(config, vocab, runner.dtype, peak - weights)
                   + penalty_slot_bytes(config.max_num_seqs, vocab))
        # our share of the card, minus what we already use at peak; never more than is actually free
        available = int(min(total * config.gpu_memory_fraction - peak - reserve,
                            free - reserve - (peak - outside - torch.cuda.memory_allocated())))
        num_blocks = max(available, 0) // per_block
        runner.profile = {"peak_bytes": peak, "total_bytes": total, "free_bytes": free,
                          "kv_bytes": num_blocks * per_block}
    if num_blocks < per_seq_blocks:
        need = per_seq_blocks * per_block
        state = ""
        if runner.state is not None:
            state = (f" after {runner.state.num_slots + runner.state.num_snapshots} state slots "
                     f"({state_bytes / GiB:.2f} GiB; fewer with a lower --max-num-seqs)")
        raise ValueError(
            f"the KV cache cannot hold one sequence of max_model_len={runner.max_model_len}: it needs "
            f"{per_seq_blocks} blocks ({need / GiB:.2f} GiB) but only {max(available, 0) / GiB:.2f} GiB "
            f"({num_blocks} blocks) are available{state}; lower --max-model-len or raise --gpu-memory-fraction "
            f"(or kv_cache_memory_bytes on CPU)"
        )
    return int(num_blocks)
