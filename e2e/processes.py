"""The e2e tests' own background processes (an operator, gateways): started with a log file, stopped gently."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def start_process(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Run cmd with its output appended to log_path, from log_path's folder: a cwd inside the checkout would let
    its top-level operator/ shadow the standard library's operator."""
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGINT (kopf and uvicorn shut down cleanly on it), then kill after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
