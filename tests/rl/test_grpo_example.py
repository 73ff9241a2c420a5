"""examples/grpo.py for two steps on CPU with the bundled model, weights pushed over the gloo broadcast path:
after each update the engine's log-probs of the probe must equal the trainer's new policy (the example asserts
it and prints the figures), and weight_version must have moved once per step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def test_grpo_two_steps_over_gloo(smollm2_path, tmp_path):
    cmd = [sys.executable, str(EXAMPLE), "--steps", "2", "--device", "cpu", "--broadcast", "--model", str(smollm2_path)]
    # cwd away from the repository root, whose operator/ folder would shadow the standard library's
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    steps = re.findall(r"step (\d): .*-> weight_version (\d+) \| probe: engine vs trainer (\S+), moved (\S+)", out)
    assert [s[0] for s in steps] == ["0", "1"], out[-4000:]
    versions = [int(s[1]) for s in steps]
    assert versions[1] == versions[0] + 1
    for _, _, err, moved in steps:
        assert float(err) <= 1e-3 < float(moved)
    assert "ok: 2 GRPO steps" in out
