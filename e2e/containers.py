"""One container of a pod as a local process: start, exit detection, stop, and its status entry."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

from probes import ProbeState, probe_states


def rfc3339(ts: float | None = None) -> str:
    dt = datetime.datetime.fromtimestamp(ts if ts is not None else time.time(), datetime.timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: with the pid it identifies a process despite pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class Container:
    """A container's process across restarts: restartCount, last termination, probe state."""

    def __init__(self, spec: dict, log_path: Path, pid_path: Path):
        self.spec = spec
        self.name = spec["name"]
        self.log_path = log_path
        self.pid_path = pid_path
        self.proc: subprocess.Popen | None = None
        self.started_wall = 0.0
        self.started_mono = 0.0
        self.restart_count = -1          # incremented on every start; the first start makes it 0
        self.last_termination: dict | None = None
        self.current_termination: dict | None = None  # set while exited and not yet restarted
        self.waiting_reason = "ContainerCreating"
        self.waiting_message = ""
        self.restart_at: float | None = None
        self.probes: dict[str, ProbeState] = {}
        self.env: dict[str, str] = {}

    # --- process ---------------------------------------------------------------------------
    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self.env = env
        with open(self.log_path, "ab") as log:
            log.write(f"--- {rfc3339()} starting {argv!r}\n".encode())
            log.flush()
            # A session of its own: stop() signals the whole group (shell wrappers, workers).
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_path.write_text(f"{self.proc.pid} {process_start_time(self.proc.pid)}\n")
        self.started_wall, self.started_mono = time.time(), time.monotonic()
        self.restart_count += 1
        if self.current_termination is not None:
            self.last_termination = self.current_termination
        self.current_termination = None
        self.restart_at = None
        self.probes = probe_states(self.spec, self.started_mono)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> bool:
        """If the process just exited, record its termination; True when that happened."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        # A negative returncode means killed by a signal; kubelet reports 128+signal.
        exit_code = 128 - code if code < 0 else code
        self.current_termination = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": rfc3339(self.started_wall),
            "finishedAt": rfc3339(),
        }
        if code < 0:
            self.current_termination["signal"] = -code
        self.proc = None
        self.probes = {}
        self.pid_path.unlink(missing_ok=True)
        return True

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_seconds: float) -> None:
        """SIGTERM, wait up to the grace period, then SIGKILL; the process group goes with it."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(grace_seconds, 0.1))
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
        # Children that left the group leader's exit behind still die with the group.
        self.signal_group(signal.SIGKILL)
        self.reap()

    # --- status ----------------------------------------------------------------------------
    def started(self) -> bool:
        startup = self.probes.get("startupProbe")
        return self.running() and (startup is None or startup.verdict is True)

    def ready(self) -> bool:
        if not self.started():
            return False
        readiness = self.probes.get("readinessProbe")
        return readiness is None or readiness.verdict is True

    def status(self) -> dict:
        if self.running():
            state = {"running": {"startedAt": rfc3339(self.started_wall)}}
        elif self.current_termination is not None and self.restart_at is None:
            state = {"terminated": self.current_termination}
        else:
            state = {"waiting": {"reason": self.waiting_reason}}
            if self.waiting_message:
                state["waiting"]["message"] = self.waiting_message
        entry = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"pagefleet://{self.proc.pid}" if self.proc else "",
            "ready": self.ready(),
            "started": self.started(),
            "restartCount": max(self.restart_count, 0),
            "state": state,
            "lastState": {"terminated": self.last_termination} if self.last_termination else {},
        }
        return entry
