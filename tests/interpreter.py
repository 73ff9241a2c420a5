"""Run a file of Triton kernel tests under the Triton interpreter (TRITON_INTERPRET=1), in a child process.

The variable must be set before Triton is imported, so a test of this process cannot turn the interpreter on
for itself: it launches pytest on the kernel file with the variable set, and fails with the child's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(test_file: Path, timeout: float) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(test_file)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
