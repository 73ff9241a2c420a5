"""The GPU benchmarks added in run V refuse bad flags before they load anything: exit 2 and say which flag."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script, flags, says", [
    ("eager_bench.py", ["--dtypes", "fp16"], "--dtypes takes bf16, fp8 or both"),
    ("mixed_bench.py", ["--workloads", "512"], "--workloads 256,2048"),
    ("mixed_bench.py", ["--max-num-seqs", "0"], "--max-num-seqs positive integers"),
    ("mixed_bench.py", ["--dtypes", "int8"], "--dtypes takes bf16,fp8"),
    ("fp8_quality.py", ["--prompts", "0"], "--prompts takes 1..8"),
    ("fp8_quality.py", ["--tokens", "0"], "--tokens 1 or more"),
])
def test_bad_flags_exit_2_with_the_flag_named(script, flags, says, tmp_path):
    p = subprocess.run([sys.executable, str(BENCH / script), *flags], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 2 and says in p.stderr, p.stderr[-500:]
