"""Real PEFT LoRA adapters for the bundled model, written by PEFT itself, for the e2e tests."""

from __future__ import annotations

from pathlib import Path


def make_adapters(base_model: str, root: Path, names_and_scales: list[tuple[str, float]]) -> None:
    """One folder per adapter under root, each with its own random A and B (B ~ N(0, scale)), so each
    changes the model's greedy text in its own way."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    for seed, (name, scale) in enumerate(names_and_scales):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                                init_lora_weights=False))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, scale)
        model.save_pretrained(root / name)
        base = model.unload()  # the plain model again, for the next adapter
