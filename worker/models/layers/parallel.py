"""Tensor parallelism inside the model: this process's rank and group, the collectives of a sharded forward, and
how each checkpoint tensor is cut into this rank's shard.

Megatron's layout, as vLLM and SGLang serve it: q/k/v and gate/up (and the Gated DeltaNet in-projections, conv
channels and per-head gates) are split by heads and columns, o_proj / down_proj / out_proj by their input rows, so
each layer's two halves need one all-reduce each; the embedding and lm_head are split by vocabulary rows (padded to
a multiple of the ranks). KV heads are split when there are at least as many as ranks and replicated otherwise
(each rank keeps the one its query heads read). Norms are replicated. A row-parallel bias is added by rank 0 only,
so the all-reduced sum holds it once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from pagefleet.worker.models.registry import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup (gloo on CPU, NCCL on GPUs); None at size 1
    full: ModelConfig | None = None  # the unsharded model config (the checkpoint's shapes)
    device: torch.device | None = None  # where the group's tensors live (the CPU for gloo)


_tp = TensorParallel()


def set_tensor_parallel(tp: TensorParallel) -> None:
    """This process's rank for good (a worker process holds one rank of one engine)."""
    global _tp
    _tp = tp


@contextmanager
def using(tp: TensorParallel) -> Iterator[TensorParallel]:
    """tp for what runs inside (rank 0 is the engine's process, where other engines may run at one rank)."""
    global _tp
    previous, _tp = _tp, tp
    try:
        yield tp
    finally:
        _tp = previous


def get_tensor_parallel() -> TensorParallel:
    return _tp


# ---- the model config of one rank


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError, naming the model's sizes, unless `size` ranks can split this model."""
    if size == 1:
        return
    c = config
    need = [("attention heads", c.num_attention_heads), ("MLP intermediate size", c.intermediate_size)]
    if c.layer_types is not None and "linear_attention" in c.layer_types:
        need += [("Gated DeltaNet key heads", c.linear_num_key_heads),
                 ("Gated DeltaNet value heads", c.linear_num_value_heads)]
    for what, n in need:
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {n} {what}")
    kv = c.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other "
                         f"(KV heads are split across ranks, or replicated when there are fewer than ranks)")


def padded_vocab(vocab_size: int, size: int) -> int:
    """Vocabulary rows per rank: the vocabulary padded to a multiple of the ranks."""
    return -(-vocab_size // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model config one of `size` ranks builds its layers from (per-rank heads, columns and vocabulary)."""
    if size == 1:
        return config
    check_tensor_parallel(config, size)
    c = config
    return replace(c, vocab_size=padded_vocab(c.vocab_size, size),
                   intermediate_size=c.intermediate_size // size,
                   num_attention_heads=c.num_attention_heads // size,
                   num_key_value_heads=max(1, c.num_key_value_heads // size),
                   linear_num_key_heads=c.linear_num_key_heads // size,
                   linear_num_value_heads=c.linear_num_value_heads // size)


# ---- the collectives (no-ops at size 1)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of every rank's partial x, in place: after a row-parallel linear."""
    tp = _tp
    if tp.size == 1:
        return x
    tp.group.allreduce([x]).wait()
    return x


def embed(embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel lookup: each rank embeds the ids in its rows (zeros for the rest), then the sum."""
    tp = _tp
    if tp.size == 1:
        return embedding(ids)
    rows = embedding.weight.shape[0]
    local = ids - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    out = embedding(torch.where(inside, local, 0)) * inside.unsqueeze(-1).to(embedding.weight.dtype)
    return all_reduce(out)


def gather_logits(local: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's vocabulary slice of the logits [rows, V / ranks], joined into [rows, V] (the padding dropped),
    into `out` when given."""
    tp = _tp
    vocab = tp.full.vocab_size
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    tp.group.allgather([parts], [local.contiguous()]).wait()
    full = torch.cat(parts, dim=-1)[:, :vocab]
    if out is None:
        return full
    out.copy_(full)
    return out


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place."""
    tp = _tp
    if tp.size == 1:
        return x
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    tp.group.broadcast([x], opts).wait()
    return x


def agree_min(value: int) -> int:
    """The smallest of every rank's value (KV blocks, state slots: every rank must hold the same number)."""
    tp = _tp
    if tp.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=tp.device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    tp.group.allreduce([t], opts).wait()
    return int(t.item())


# ---- checkpoint tensors -> this rank's shard
#
# (our parameter name, shard) as map_weight_name gives them -> how the checkpoint tensor splits. Column kinds cut
# dim 0, row kinds dim 1; "qkv" / "conv" are the Gated DeltaNet's [q | k | v] channels, each cut by heads.

_RULES = [
    (re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$"), "vocab"),
    (re.compile(r"\.(o_proj|down_proj|out_proj)\.weight$"), "row"),
    (re.compile(r"\.(o_proj|down_proj|out_proj)\.bias$"), "row_bias"),
    (re.compile(r"\.(qkv_proj|gate_up_proj|in_proj)\.(weight|bias)$"), "column"),
    (re.compile(r"\.linear_attn\.(conv_weight|A_log|dt_bias)$"), "column"),
]


def _kind(target: str) -> str | None:
    for pattern, kind in _RULES:
        if pattern.search(target):
            return kind
    return None


def _block(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim]
    if n % size:
        raise ValueError(f"{n} rows do not split over {size} ranks")
    return t.narrow(dim, rank * (n // size), n // size)


def shard_tensor(target: str, shard: object, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a checkpoint tensor bound for `target` (its packed `shard`), as load_weight takes it."""
    tp = _tp
    if tp.size == 1:
        return tensor
    kind = _kind(target)
    if kind is None:
        return tensor  # replicated: norms and the rest
    rank, size, c = tp.rank, tp.size, tp.full
    if kind == "vocab":
        rows = padded_vocab(c.vocab_size, size)
        part = tensor[rank * rows:(rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's padding rows: zero logits, sliced off by gather_logits
            pad = tensor.new_zeros(rows - part.shape[0], *tensor.shape[1:])
            part = torch.cat([part, pad])
        return part
    if kind == "row":
        return _block(tensor, 1, rank, size)
    if kind == "row_bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if shard in ("k", "v"):
        kv = c.num_key_value_heads
        if kv >= size:
            return _block(tensor, 0, rank, size)
        head = rank * kv // size  # the KV head this rank's query heads read
        return tensor.narrow(0, head * c.head_dim, c.head_dim)
    if shard == "qkv" or shard == "conv":  # [q | k | v] channels of the Gated DeltaNet conv
        key = c.linear_num_key_heads * c.linear_key_head_dim
        parts = tensor.split([key, key, c.linear_num_value_heads * c.linear_value_head_dim], dim=0)
        return torch.cat([_block(p, 0, rank, size) for p in parts])
    return _block(tensor, 0, rank, size)  # q (with its gate), gate / up, z, b, a, A_log, dt_bias
