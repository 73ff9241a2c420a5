"""A reasoning model's vocabulary for the tests: the bundled tokenizer with `<think>` and `</think>` added as
single tokens (as Qwen3 has them: added, not special, so they stay in the decoded text), a Qwen3-style chat
template, and a tiny random Qwen3 checkpoint over it.

The template's generation prompt follows the last user message's ending: "/no_think" (or the template variable
enable_thinking=False, as Qwen3's reads it) gives Qwen3's non-thinking prompt (`<think>\n\n</think>\n\n`), "/think"
opens the block
(`<think>\n`, as DeepSeek-R1's and Qwen3-Thinking's templates do), anything else leaves the block to the model
(Qwen3's thinking mode). Earlier assistant turns keep their think blocks, so a closed block can sit in the history.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagefleet.worker.models.loader import bundled_model_path

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if messages[-1]['content'].endswith('/no_think') or enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n"
    "{% elif messages[-1]['content'].endswith('/think') %}<think>\n{% endif %}{% endif %}"
)
VOCAB = 49216  # the model's logits rows: past the tokenizer's 49154 ids, as real checkpoints pad them


def think_tokenizer(folder: Path):
    """The bundled tokenizer plus `<think>` / `</think>` and THINK_TEMPLATE, saved to folder and loaded back."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = THINK_TEMPLATE
        tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def think_model(folder: Path) -> Path:
    """A tiny random Qwen3 over think_tokenizer's vocabulary (peaked logits: greedy choices are not near-ties)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (folder / "config.json").exists():
        return folder
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         eos_token_id=2, bos_token_id=1, tie_word_embeddings=False, initializer_range=0.5)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    think_tokenizer(folder)
    return folder
