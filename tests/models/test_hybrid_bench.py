"""benchmarks/hybrid_bench.py --tiny on CPU: make, check and run through the script's command line on a tiny Qwen3.5
config (Qwen3_5ForConditionalGeneration with a one-block vision tower the engine skips). The check must pass and
catch every bug variant it prints for scale; run must report every workload with the tokens it asked for, the
engine's picks and the table beside the vLLM anchor. CPU timings mean nothing and are not asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_bench.py"


def bench(*args, cwd) -> subprocess.CompletedProcess:
    # cwd away from the repository root, whose operator/ folder would shadow the standard library's
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args), "--tiny"], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def load_script():
    spec = importlib.util.spec_from_file_location("hybrid_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hybrid_bench", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_make_check_and_run_on_a_tiny_config(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    bench("make", ckpt, cwd=tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert load_script().make(str(ckpt), tiny=True) == {"folder": str(ckpt), "made": False}  # not made again

    done = bench("check", "--out", out, cwd=tmp_path)
    check = json.loads((out / "hybrid_check.json").read_text())
    assert check["passed"] and "CHECK PASS" in done.stdout
    ours = check["ours"]  # fp32 on both sides
    assert ours["positions"] == 8 * 17 and ours["max_abs"] < 0.01 and ours["top1_agree"] >= 0.95
    assert check["engine"]["mixed_steps"] > 0 and check["engine"]["max_prefill_tokens"] <= 16
    assert len(check["bugs"]) == 3 and all(b["caught"] for b in check["bugs"].values())

    done = bench("run", ckpt, out, "--grpo-prompts", 2, cwd=tmp_path)
    results = json.loads((out / "hybrid_bench.json").read_text())
    figures = results["figures"]
    assert list(figures) == ["batch1", "mixed256", "mixed256_t1", "grpo", "mixed2048"]
    assert figures["batch1"]["output_tokens"] == 8
    assert figures["batch1"]["weights_bound_tok_per_s"] == pytest.approx(4.27e12 / results["engine"]["weight_bytes"],
                                                                          rel=1e-2)
    assert figures["mixed256"]["requests"] == 8 and figures["mixed256"]["output_tokens"] == sum(
        o for _, o in results["workloads_drawn"]["mixed"])
    assert figures["mixed256_t1"]["output_tokens"] == figures["mixed256"]["output_tokens"]
    assert figures["grpo"]["output_tokens"] == 2 * 4 * 8 and figures["grpo"]["n"] == 4
    assert figures["mixed2048"]["requests"] == 16 and figures["mixed2048"]["output_tokens"] == sum(
        o for _, o in results["workloads_drawn"]["mixed2048"])
    assert all(f["output_tok_per_s"] > 0 for f in figures.values())
    assert figures["batch1"]["vllm_anchor"] == 63.6 and figures["mixed256"]["vllm_anchor"] == 2647.5
    assert figures["grpo"]["vllm_anchor"] is None and figures["grpo"]["ratio"] is None
    engine = results["engine"]
    assert engine["state_slots"] >= 1 and engine["max_num_seqs"] <= engine["state_slots"]
    assert set(engine["init_split_s"]) >= {"load", "warmup", "graphs"}
    table = done.stdout[done.stdout.index("workload "):]
    assert "vLLM anchor, same H200 kind, not side by side" in done.stdout
    assert "GRPO 2 prompts x n=4" in table and "engine init" in table and "state slots" in table
    assert "batch 1 ceiling" in table
