"""Triton kernels under the Triton interpreter (TRITON_INTERPRET=1), each run in a child process started early.

The variable must be set before Triton is imported, so a test of this process cannot turn the interpreter on
for itself: it launches a child with the variable set (pytest on a kernel test file, or a benchmark's dry run)
and fails with the child's output. The children are numpy loops on one core each, ~6 min in all on CI's two
cores, so they do not wait their turn: when collection ends, conftest.py starts every child a collected test
reads, at the lowest CPU priority, where they use the cycles the rest of the suite leaves idle (servers
loading, the e2e control plane's waits), and it moves the tests that read them to the end of the run. A test
marked `@pytest.mark.interpreter(NAME)` calls `check(NAME)`; run alone, it starts its child itself.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "tests" / "kernels"


def _pytest(test_file: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(test_file)]


# name -> (argv, what its output must show besides exit code 0)
CHILDREN: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "kernels": (_pytest(KERNELS / "test_kernels_triton.py"), (" passed",)),
    "gdn": (_pytest(KERNELS / "test_gdn_triton.py"), (" passed",)),
    "sampling": (_pytest(KERNELS / "test_sampling_triton.py"), (" passed",)),
    # every variant benchmarks/gdn_tile_bench.py would time on the GPU, checked against the reference first
    "gdn_tile_bench": ([sys.executable, str(ROOT / "benchmarks" / "gdn_tile_bench.py"), "--dry-run", "--prefill"],
                       ("every variant matches the reference", "2 of 2 variants launch and match")),
}


@dataclass
class Child:
    proc: subprocess.Popen
    stdout: Path
    stderr: Path
    started: float


_running: dict[str, Child] = {}


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def start(name: str) -> None:
    """Start the child `name` (once), niced to the lowest priority: it runs on the CPU the suite leaves idle."""
    if name in _running:
        return
    argv, _ = CHILDREN[name]
    out = Path(tempfile.mkdtemp(prefix=f"pagefleet-interpreter-{name}-"))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen(["nice", "-n", "19", *argv], env=env, cwd=ROOT, stdout=so, stderr=se,
                                stdin=subprocess.DEVNULL)
    _running[name] = Child(proc, out / "stdout", out / "stderr", time.monotonic())


def check(name: str, timeout: float) -> str:
    """Wait for the child `name` (started now if it was not) and fail with its output unless it passed; returns
    its stdout. timeout: seconds from now, enough for every child at once on two cores (~6 min of work): once
    this process waits, the children share the CPU it leaves."""
    start(name)
    child = _running[name]
    try:
        code = child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        child.proc.kill()
        child.proc.wait()
        ran = time.monotonic() - child.started
        raise AssertionError(f"the interpreter child {name!r} ran past {timeout} s (started {ran:.0f} s ago): "
                             f"{child.stdout.read_text()[-3000:]}") from e
    stdout, stderr = child.stdout.read_text(), child.stderr.read_text()
    assert code == 0, stdout[-6000:] + stderr[-3000:]
    _, shows = CHILDREN[name]
    for text in shows:
        assert text in stdout, f"{name!r}: {text!r} not in its output:\n{stdout[-3000:]}"
    if "pytest" in CHILDREN[name][0]:
        assert "skipped" not in stdout, stdout[-2000:]  # a kernel test that skips under the interpreter is a hole
    return stdout


def stop_all() -> None:
    """End the children no test waited for (a run cut short, or deselected after they started)."""
    for child in _running.values():
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
    _running.clear()
