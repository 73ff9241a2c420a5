"""benchmarks/rl_bench.py --tiny on CPU: every section's code path on a tiny random checkpoint (the trainer process
handing tensors over by shared-memory handles where the GPU run uses CUDA IPC, sleep mode's host emulation), with
the script's own checks: weights B from disk and from the trainer agree, updating back to A gives A's tokens and
weights, greedy tokens survive a level-1 sleep, level 2 refuses generation until A is reloaded. Timings on CPU mean
nothing and are not asserted; the GPU figures come from the same script on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_bench.py"


def run(*args, cwd):
    # cwd away from the repository root, whose operator/ folder would shadow the standard library's
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=800, cwd=cwd)


def test_every_section_runs_on_cpu_and_its_checks_pass(tiny_models, tmp_path):
    model = tiny_models["llama"]
    done = run(tmp_path / "out", "--tiny", "--model", model, "--grpo-model", model, "--root", tmp_path / "ckpt",
               cwd=tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    results = json.loads((tmp_path / "out" / "rl_bench.json").read_text())
    assert results["failed"] == [] and "errors" not in results, log[-4000:]

    update = results["update"]
    checks = update["checks"]
    assert all(checks.values()) and len(checks) == 2 + 3 + 8 * 3  # disk B, disk A, 8 IPC updates
    assert checks["disk B: greedy tokens differ from A's"]
    assert checks["IPC per-tensor B #0: greedy tokens as expected"]  # B over handles == B from disk
    assert checks["IPC flat A #1: weights as expected"]  # back to A, bit for bit
    assert update["bytes"] > 0 and len(update["disk_s"]) == 2
    for layout in ("per-tensor", "flat"):
        runs = update[f"ipc_{layout}"]
        assert len(runs) == 4 and all(r["total_s"] >= r["engine_s"] > 0 for r in runs)
        assert all(r["handle_chars"] < 100_000 for r in runs)  # handles, not the weights

    sleep = results["sleep"]
    assert [r["level"] for r in sleep["runs"]] == [1, 1, 2]
    assert sleep["held_bytes"] > 0 and all(r["returned_fraction"] >= 0.95 for r in sleep["runs"])
    assert sleep["runs"][0]["neighbour"]["ok"] and sleep["runs"][2]["neighbour"]["ok"]
    assert "reload_s" in sleep["runs"][2] and all(sleep["checks"].values()) and len(sleep["checks"]) == 7

    grpo = results["grpo"]
    assert len(grpo["steps"]) == 2 and grpo["speedup"] > 0
    assert grpo["chat_prompts"] == (model / "chat_template.jinja").exists()  # the bundled tokenizer's template
    assert all(0 < s["ours_tokens"] <= grpo["prompts"] * grpo["n"] * grpo["max_tokens"] for s in grpo["steps"])

    table = done.stdout[done.stdout.index("section | what | figure | goal"):]
    assert "IPC from a trainer process, per-tensor" in table and "level 2 #0: sleep" in table and "grpo" in table
    assert "checks: all pass" in table


def test_bad_arguments_are_refused_with_the_reason(tmp_path):
    done = run(tmp_path / "out", "updates", "--tiny", "--model", tmp_path, cwd=tmp_path)
    assert done.returncode == 2 and "unknown section(s) updates" in done.stderr
    done = run(tmp_path / "out", "sleep", "--tiny", cwd=tmp_path)
    assert done.returncode == 2 and "--tiny needs --model" in done.stderr
