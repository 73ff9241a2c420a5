"""The paged KV cache: one allocation for every layer's K and V blocks, its size, and block copies."""

from __future__ import annotations

import torch

from pagefleet.worker.models.layers.context import forward_context
from pagefleet.worker.models.layers.paged_attention import AttentionMetadata
from pagefleet.worker.executor.graphs.decode import static_logits_bytes
from pagefleet.worker.executor.graphs.mixed import mixed_graph_bytes
from pagefleet.worker.models.registry import ModelConfig
from pagefleet.worker.executor.graphs.prompt import prompt_graph_bytes

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 1 * GiB
GRAPH_RESERVE_BYTES = 512 << 20  # CUDA graph pool and workspace, kept out of the KV budget so capture cannot OOM


def block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * dtype.itemsize


class KVCache:
    def __init__(self, mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        # [K/V, layer, block, slot, kv head, head dim]: a block of a layer is contiguous, as the kernels expect
        self.data = torch.zeros(2, mc.num_hidden_layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=device)

    def bind(self, model: torch.nn.Module) -> None:
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.attn.k_cache = self.data[0, i]
            layer.self_attn.attn.v_cache = self.data[1, i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V) before the step writes into them."""
        src = torch.tensor([s for s, _ in copies], device=self.data.device)
        dst = torch.tensor([d for _, d in copies], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]


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
    meta = AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.long, device=dev),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        max_seq_len=max(lens),
        is_decode=False,
    )
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    with forward_context(meta):
        hidden = runner.model(torch.zeros(cu[-1], dtype=torch.long, device=dev), positions)
    rows = min(config.max_num_seqs, cu[-1])
    logits = runner.model.compute_logits(hidden[:rows])
    # the sampler's widest path: sort for top-p over a full batch of rows
    logits.float().sort(dim=-1, descending=True)[0].softmax(-1).cumsum(-1)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def size_kv_cache(runner, config, mc: ModelConfig) -> int:
    """Number of KV blocks: forced, from the CPU byte budget, or what the GPU fraction leaves after profiling."""
    per_block = block_bytes(mc, config.block_size, runner.dtype)
    per_seq_blocks = runner.max_blocks_per_seq
    if config.num_gpu_blocks_override:
        num_blocks = config.num_gpu_blocks_override
        available = num_blocks * per_block
    elif runner.device.type != "cuda":
        available = config.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
        # more blocks than every sequence at full length can use is wasted host memory
        num_blocks = min(available // per_block, config.max_num_seqs * per_seq_blocks + 1)
    else:
        weights = torch.cuda.memory_allocated()  # the model, before the profiled step's activations
        peak = profile_peak_bytes(runner, config)
        free, total = torch.cuda.mem_get_info()
        reserve = 0 if config.enforce_eager else (
            GRAPH_RESERVE_BYTES + static_logits_bytes(mc, config.max_num_seqs, runner.dtype)
            + prompt_graph_bytes(peak - weights, config.max_num_batched_tokens, mc.vocab_size, runner.dtype)
            + mixed_graph_bytes(peak - weights, config.max_num_seqs, config.max_num_batched_tokens, mc.vocab_size, runner.dtype))
        # our share of the card, minus what we already use at peak; never more than is actually free
        available = int(min(total * config.gpu_memory_fraction - peak - reserve, free - reserve - (peak - torch.cuda.memory_allocated())))
        num_blocks = max(available, 0) // per_block
        runner.profile = {"peak_bytes": peak, "total_bytes": total, "free_bytes": free, "kv_bytes": num_blocks * per_block}
    if num_blocks < per_seq_blocks:
        need = per_seq_blocks * per_block
        raise ValueError(
            f"the KV cache cannot hold one sequence of max_model_len={runner.max_model_len}: it needs "
            f"{per_seq_blocks} blocks ({need / GiB:.2f} GiB) but only {max(available, 0) / GiB:.2f} GiB "
            f"({num_blocks} blocks) are available; lower --max-model-len or raise --gpu-memory-fraction "
            f"(or kv_cache_memory_bytes on CPU)"
        )
    return int(num_blocks)
