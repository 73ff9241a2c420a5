"""LoRA adapters: PEFT folders loaded into slots of stacked A/B buffers and applied per token, hot-swapped.

Every target Linear gets buffers for `max_loras` adapters, A [slots, R, in] and B [slots, out, R], with each
adapter's scale folded into B. A packed module (q/k/v, gate/up) stacks its shards' A matrices along R and
places each shard's B in that shard's output rows, so one low-rank product serves every shard. Loading
or unloading an adapter writes one slot between steps: nothing restarts and no other adapter moves. A
step applies each adapter present to its own token rows (steps with adapters run eagerly, not from a
CUDA graph).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.worker.models.layers.context import current_lora

# PEFT module name -> (our packed module, shard within it)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}

@dataclass
class LoRAMapping:
    rows_by_slot: list[tuple[int, torch.Tensor]]  # (slot, token row indices on the device)


class LoRAWeights:
    """The adapter slots of one Linear (not parameters: the checkpoint loader never sees them)."""

    def __init__(self, in_features: int, shards: list[tuple[int, int]], max_loras: int, max_rank: int, dtype, device):
        self.shards = shards  # (first output row, rows) of each shard
        self.max_rank = max_rank
        r = max_rank * len(shards)
        self.a = torch.zeros(max_loras, r, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, sum(n for _, n in shards), r, dtype=dtype, device=device)

    def write(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        start, rows = self.shards[shard]
        if a.shape[1] != self.a.shape[2] or b.shape[0] != rows:
            raise ValueError(f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a linear of "
                             f"{self.a.shape[2]} inputs and {rows} outputs: was the adapter made for another model?")
        cols = slice(shard * self.max_rank, shard * self.max_rank + a.shape[0])
        self.a[slot, cols] = a.to(self.a.dtype)
        self.b[slot, start : start + rows, cols] = b.to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mapping = current_lora()  # this step's token rows per adapter slot (models/layers/context.py)
        if mapping is None:
            return out
        for slot, rows in mapping.rows_by_slot:
            xs = x.index_select(0, rows)
            out.index_add_(0, rows, (xs @ self.a[slot].T) @ self.b[slot].T)
        return out


class LoRAManager:
    """Adapters by name: which slot each occupies, and the id that keeps their prefix-cache entries apart."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype, device):
        self.max_loras, self.max_rank, self.device = max_loras, max_rank, device
        self.slot_of: dict[str, int] = {}
        self.path_of: dict[str, str] = {}  # as given to load(): what /load reports, for the operator's sync
        self.id_of: dict[str, int] = {}  # a fresh id per load: a reloaded name never meets its old cache
        self.slot_of_id: dict[int, int] = {}
        self._ids = itertools.count(1)
        c = model.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        shards = {
            "self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
            "self_attn.o_proj": [(0, c.hidden_size)],
            "mlp.gate_up_proj": [(0, inter), (inter, inter)],
            "mlp.down_proj": [(0, c.hidden_size)],
        }
        self.layers: list[dict[str, LoRAWeights]] = []
        for layer in model.model.layers:
            weights = {}
            for name, module_shards in shards.items():
                linear = layer.get_submodule(name)
                linear.lora = weights[name] = LoRAWeights(linear.in_features, module_shards, max_loras, max_rank,
                                                          dtype, device)
            self.layers.append(weights)

    @property
    def names(self) -> list[str]:
        return list(self.slot_of)

    def load(self, name: str, path: str) -> int:
        """Read a PEFT adapter folder into a free slot; returns its id. ValueError says what is wrong."""
        tensors, config = read_peft_folder(Path(path))
        return self.load_tensors(name, tensors, config, path)

    def load_tensors(self, name: str, tensors: dict[str, torch.Tensor], config: dict, path: str = "<tensors>") -> int:
        """An adapter from its PEFT tensors (names as in adapter_model.safetensors) and adapter_config fields,
        into a free slot; returns its id. Every tensor is checked before a slot is written; path is what
        /load reports for it."""
        if name in self.slot_of:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"all {self.max_loras} LoRA slots are in use (--max-loras); unload one first")
        pairs, scale = peft_adapter(tensors, config, self.max_rank, len(self.layers))
        for (layer, target), pair in pairs.items():
            module, shard = TARGETS[target]
            pair.shard(module, shard)
            pair.check(self.layers[layer][module], shard)
        slot = free[0]
        self._clear(slot)  # a failed earlier load may have left part of an adapter here
        for (layer, target), pair in pairs.items():
            module, shard = TARGETS[target]
            self.layers[layer][module].write(slot, shard, pair.a.to(self.device), (pair.b * scale).to(self.device))
        lora_id = next(self._ids)
        self.slot_of[name], self.id_of[name], self.slot_of_id[lora_id] = slot, lora_id, slot
        self.path_of[name] = path
        return lora_id

    def unload(self, name: str) -> None:
        if name not in self.slot_of:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slot_of.pop(name)
        del self.path_of[name]
        del self.slot_of_id[self.id_of.pop(name)]
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        for weights in self.layers:
            for w in weights.values():
                w.clear(slot)

    def mapping(self, seqs, counts) -> LoRAMapping | None:
        """Token rows of this step per adapter slot; None when no sequence uses an adapter."""
        rows = self.slot_rows(seqs, counts)
        return None if rows is None else self.mapping_of(rows)

    def slot_rows(self, seqs, counts) -> list[tuple[int, list[int]]] | None:
        """(slot, token rows) of this step's adapters, on the host; None when no sequence uses one."""
        rows: dict[int, list[int]] = {}
        start = 0
        for seq, n in zip(seqs, counts, strict=True):
            if seq.lora_id:
                rows.setdefault(self.slot_of_id[seq.lora_id], []).extend(range(start, start + n))
            start += n
        return list(rows.items()) or None

    def mapping_of(self, rows_by_slot: list[tuple[int, list[int]]]) -> LoRAMapping:
        """The mapping of (slot, token rows) pairs, on the device (a tensor-parallel worker gets the pairs)."""
        return LoRAMapping([(slot, torch.tensor(r, dtype=torch.long, device=self.device)) for slot, r in rows_by_slot])


@dataclass
class AdapterPair:
    """One adapted linear's lora_A [r, in] and lora_B [out, r], with their PEFT names for errors."""

    a_name: str
    a: torch.Tensor
    b_name: str
    b: torch.Tensor

    def shard(self, module: str, shard: int) -> None:
        """This tensor-parallel rank's part, as its linear is cut: B's output rows of a column-parallel linear
        (q/k/v, gate/up), A's input columns of a row-parallel one (o_proj, down_proj), whose partial product
        the layer's all-reduce then sums with the partial outputs."""
        from pagefleet.worker.models.layers.parallel import shard_tensor

        if module.endswith(("o_proj", "down_proj")):
            self.a = shard_tensor(f"{module}.weight", None, self.a)
        else:
            packed = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": (0, 1)}[module][shard]
            self.b = shard_tensor(f"{module}.weight", packed, self.b)

    def check(self, weights: LoRAWeights, shard: int) -> None:
        """Against the model's linear, naming the tensor that does not fit (another model's adapter)."""
        r, inputs, rows = self.a.shape[0], weights.a.shape[2], weights.shards[shard][1]
        for name, t, want in ((self.a_name, self.a, (r, inputs)), (self.b_name, self.b, (rows, r))):
            if tuple(t.shape) != want:
                raise ValueError(f"LoRA tensor {name!r} has shape {tuple(t.shape)}, but this model's linear needs "
                                 f"{want}: was the adapter made for another model?")


def read_peft_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and adapter_config.json of a PEFT LoRA folder."""
    from safetensors.torch import load_file

    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a LoRA adapter folder: adapter_config.json is missing")
    if not weights_path.is_file():
        raise ValueError(f"{folder} has no adapter_model.safetensors (only safetensors adapters are read)")
    tensors = load_file(str(weights_path))
    if not tensors:
        raise ValueError(f"{weights_path} holds no LoRA weights")
    return tensors, json.loads(config_path.read_text())


def peft_adapter(tensors: dict[str, torch.Tensor], config: dict, max_rank: int,
                 num_layers: int) -> tuple[dict[tuple[int, str], AdapterPair], float]:
    """{(layer, target): its A and B} and the scale of an adapter given as PEFT tensors and adapter_config
    fields (a folder's, or a trainer's in memory), checked: each error names the tensor or field."""
    if not isinstance(config, dict):
        raise ValueError(f"the LoRA config must be a dict of adapter_config.json fields, got {type(config).__name__}")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"the LoRA config needs an integer r and a number lora_alpha, got r={r!r}, "
                         f"lora_alpha={alpha!r}")
    if not 0 < r <= max_rank:
        raise ValueError(f"adapter rank {r} is outside 1..{max_rank} (--max-lora-rank)")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise ValueError("LoRA adapters with bias or fan_in_fan_out weights are not supported")
    for field_name in ("use_dora", "rank_pattern", "alpha_pattern"):  # each changes the maths of some linears
        if config.get(field_name):
            raise ValueError(f"LoRA config field {field_name!r} is not supported")
    scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
    if not tensors:
        raise ValueError("the adapter holds no LoRA tensors")
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        parts = str(key).split(".")
        if "layers" not in parts or parts[-2] not in ("lora_A", "lora_B") or parts[-1] != "weight":
            raise ValueError(f"unsupported LoRA tensor {key!r}: only the decoder layers' linears can be adapted "
                             f"(PEFT names: ...layers.N.<module>.lora_A.weight / lora_B.weight)")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not tensor.is_floating_point():
            what = f"shape {tuple(tensor.shape)}, {tensor.dtype}" if isinstance(tensor, torch.Tensor) else \
                type(tensor).__name__
            raise ValueError(f"LoRA tensor {key!r} must be a 2-D floating-point tensor, got {what}")
        index, target = parts[parts.index("layers") + 1], parts[-3]
        if not index.isdigit():
            raise ValueError(f"unsupported LoRA tensor {key!r}: no layer number after 'layers'")
        if target not in TARGETS:
            raise ValueError(f"unsupported LoRA target {target!r} in {key!r}; supported: {', '.join(TARGETS)}")
        if int(index) >= num_layers:
            raise ValueError(f"{key!r} names layer {index}, but the model has {num_layers}")
        found.setdefault((int(index), target), {})[parts[-2]] = (str(key), tensor.float())
    out = {}
    for (layer, target), pair in found.items():
        if set(pair) != {"lora_A", "lora_B"}:
            (have, (name, _)), = pair.items()
            raise ValueError(f"{name!r} has no {'lora_B' if have == 'lora_A' else 'lora_A'} beside it")
        (a_name, a), (b_name, b) = pair["lora_A"], pair["lora_B"]
        for name, dim, size in ((a_name, 0, a.shape[0]), (b_name, 1, b.shape[1])):
            if size != r:
                raise ValueError(f"LoRA tensor {name!r} has shape {tuple((a if name == a_name else b).shape)}: "
                                 f"dimension {dim} must be the rank r = {r}")
        out[(layer, target)] = AdapterPair(a_name, a, b_name, b)
    return out, scale
