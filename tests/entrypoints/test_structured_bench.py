"""The structured-output benchmark's pieces on the CPU (benchmarks/structured_serve.sh runs them on the GPU): a
word-level tokenizer that also spells JSON (`bench serve --write-word-tokenizer DIR --json-chars`), a random
model served with it, and `bench serve --json-schema benchmarks/structured_schema.json` validating every output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pagefleet.worker.entrypoints.cli.bench_serve import JSON_CHARS, write_word_tokenizer
from servers import KEY, Server

SCHEMA = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_schema.json"
VOCAB, EOS = 512, 2


@pytest.fixture(scope="module")
def json_words_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json-words")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    done = subprocess.run([sys.executable, "-m", "pagefleet", "bench", "serve", "--write-word-tokenizer", str(folder),
                           "--json-chars"], capture_output=True, text=True, cwd=folder, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "417 words and 95 characters" in done.stdout
    return folder


def test_the_tokenizer_keeps_words_and_spells_json(json_words_model):
    tok = AutoTokenizer.from_pretrained(json_words_model)
    first = VOCAB - len(JSON_CHARS)
    assert len(tok) == VOCAB and tok.encode("t5 t6 t416") == [5, 6, 416]  # a prompt of N words is N tokens
    assert [tok.convert_tokens_to_ids(c) for c in '{"a": 1}'] == [first + ord(c) - 32 for c in '{"a": 1}']
    ids = [tok.convert_tokens_to_ids(c) for c in '{"k":'] + [7, first + ord('"') - 32, first + ord("}") - 32]
    assert tok.decode(ids + [EOS], skip_special_tokens=True) == '{"k":t7"}'  # side by side, the eos left out
    assert tok.eos_token_id == EOS


def test_an_eos_among_the_characters_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": VOCAB - 1}))
    with pytest.raises(ValueError, match="eos_token_id"):
        write_word_tokenizer(str(tmp_path), json_chars=True)


def test_bad_tokenizer_requests_get_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": VOCAB - 1}))
    for argv, message in ((["--json-chars"], "--json-chars goes with --write-word-tokenizer"),
                          (["--write-word-tokenizer", str(tmp_path), "--json-chars"], "eos_token_id 511"),
                          (["--write-word-tokenizer", str(tmp_path / "missing")], "No such file")):
        done = subprocess.run([sys.executable, "-m", "pagefleet", "bench", "serve", *argv], capture_output=True,
                              text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "tokenizer.json").exists()  # nothing written for a refused request


def test_bench_serve_validates_the_benchmark_schema_on_random_weights(json_words_model, tmp_path):
    server = Server(tmp_path / "server.log", "--model", str(json_words_model), "--max-model-len", "1024")
    try:
        out = tmp_path / "bench.json"
        cmd = [sys.executable, "-m", "pagefleet", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
               "--input-len", "32", "--output-len", "256", "--concurrency", "4", "--num-requests", "8",
               "--vocab-high", str(VOCAB - len(JSON_CHARS)), "--temperature", "1.0", "--json-schema", str(SCHEMA),
               "--json-out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:] + server.logs()
        (row,) = json.loads(out.read_text())
        assert (row["requests"], row["errors"], row["invalid_outputs"]) == (8, 0, 0), row
        assert row["cut_off_outputs"] <= 1 and row["output_tok_s"] > 0, row  # the schema bounds each output
    finally:
        server.stop()
