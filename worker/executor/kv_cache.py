"""The paged KV cache: one allocation for every layer's K and V blocks, bound to the attention layers; block copies."""

from __future__ import annotations

import torch

from pagefleet.worker.models.registry import ModelConfig


def block_bytes(mc: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """num_layers: the paged-attention layers (a hybrid model's recurrent layers keep no KV); None: all."""
    layers = mc.num_hidden_layers if num_layers is None else num_layers
    return 2 * layers * block_size * mc.num_key_value_heads * mc.head_dim * dtype.itemsize


class KVCache:
    def __init__(self, mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_layers: int | None = None):
        """num_layers: the model's paged-attention layers (len(model.attention_layers())); None: all of them."""
        self.num_blocks = num_blocks
        layers = mc.num_hidden_layers if num_layers is None else num_layers
        # [K/V, layer, block, slot, kv head, head dim]: a block of a layer is contiguous, as the kernels expect
        self.data = torch.zeros(2, layers, num_blocks, block_size, mc.num_key_value_heads, mc.head_dim,
                                dtype=dtype, device=device)

    def bind(self, model: torch.nn.Module) -> None:
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache = self.data[0, i]
            attn.v_cache = self.data[1, i]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V) before the step writes into them."""
        src = torch.tensor([s for s, _ in copies], device=self.data.device)
        dst = torch.tensor([d for _, d in copies], device=self.data.device)
        data = self.data.view(torch.uint8)  # bytes: an fp8 cache's blocks copy like any other's
        data[:, :, dst] = data[:, :, src]
