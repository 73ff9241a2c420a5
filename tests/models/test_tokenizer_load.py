"""loader.load_tokenizer: the tokenizer class named in tokenizer_config.json, imported without AutoTokenizer's
model factory, and the same tokenizer AutoTokenizer gives."""

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pagefleet.worker.entrypoints.cli.bench_serve import write_word_tokenizer
from pagefleet.worker.models.loader import load_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\nnew lines\t", "naïve café 東京 🚀", ""]


def same_tokenizer(ours, auto):
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text).input_ids == auto(text).input_ids
        ids = auto(text).input_ids
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(auto, name), name


def test_the_bundled_tokenizer_and_its_chat_template(smollm2_path):
    ours, auto = load_tokenizer(smollm2_path), AutoTokenizer.from_pretrained(str(smollm2_path))
    same_tokenizer(ours, auto)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_a_word_level_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    write_word_tokenizer(str(tmp_path))
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto)
    assert ours("t5 t6 t299").input_ids == auto("t5 t6 t299").input_ids == [5, 6, 299]


@pytest.mark.parametrize("tokenizer_class", [None, "NoSuchTokenizer", "os.system"])
def test_without_a_usable_class_name_autotokenizer_picks(smollm2_path, tmp_path, tokenizer_class):
    for f in smollm2_path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "config")):
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    same_tokenizer(load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(smollm2_path)))


def test_the_model_factory_is_not_imported(smollm2_path):
    code = ("import sys; from pathlib import Path; from pagefleet.worker.models.loader import load_tokenizer; "
            f"load_tokenizer(Path({str(smollm2_path)!r})); "
            "print(sorted(m for m in sys.modules if m.endswith('auto_factory') or m.startswith('sklearn')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(smollm2_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
