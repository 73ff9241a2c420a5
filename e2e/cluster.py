"""A real Kubernetes control plane on loopback for pagefleet's e2e tests.

    python e2e/cluster.py up   [--state-dir DIR]   # etcd, apiserver, controller-manager, scheduler, node agent
    python e2e/cluster.py env  [--state-dir DIR]   # eval "$(...)": KUBECONFIG and PATH (kubectl, helm)
    python e2e/cluster.py down [--state-dir DIR]   # stops everything, pod processes included
    python e2e/cluster.py status [--state-dir DIR]

Binaries are built from source once and cached (build_binaries.sh). A cluster's state dir holds
its certificates, kubeconfig, etcd data, component logs (logs/) and pod logs (pods/); cluster.json
there records the processes, and a second `up` on a running state dir fails instead of clobbering it.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import certs  # noqa: E402
import control_plane  # noqa: E402
from containers import process_start_time  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_STATE_DIR = Path(tempfile.gettempdir()) / "pagefleet-e2e"
COMPONENT_TIMEOUT = 90.0  # seconds for one component to become healthy (2 shared cores)


class ClusterError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_binaries() -> Path:
    """Run build_binaries.sh (a no-op when cached); its progress goes straight to our stderr."""
    done = subprocess.run(["bash", str(HERE / "build_binaries.sh")], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ClusterError(f"building the Kubernetes binaries failed (exit {done.returncode}); see above")
    return Path(done.stdout.strip().splitlines()[-1])


def _alive(pid: int, start_time: str | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


def _die_with_parent(sig: int):
    """A preexec_fn: the kernel sends `sig` to the child when the process that started it exits."""

    def preexec() -> None:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)

    return preexec


class Cluster:
    def __init__(self, state_dir: Path | str = DEFAULT_STATE_DIR, die_with_parent: bool = False):
        """die_with_parent: components stop when this process dies (pytest killed mid-run);
        the CLI leaves it off, its `up` exits while the cluster keeps running."""
        self.die_with_parent = die_with_parent
        self.state = Path(state_dir).resolve()
        self.record_path = self.state / "cluster.json"
        self.kubeconfig = self.state / "kubeconfig"
        self.logs_dir = self.state / "logs"

    # --- records ---------------------------------------------------------------------------
    def record(self) -> dict | None:
        try:
            return json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None

    def running_processes(self) -> list[dict]:
        rec = self.record() or {}
        return [p for p in rec.get("processes", []) if _alive(p["pid"], p["start_time"])]

    def env(self) -> dict[str, str]:
        rec = self.record()
        if rec is None:
            raise ClusterError(f"no cluster in {self.state}; run `e2e/cluster.sh up` first")
        return {"KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{rec['bin_dir']}{os.pathsep}{os.environ.get('PATH', '')}"}

    def _lock(self):
        """Serialises up/down on one state dir (two `up`s at the same moment)."""
        self.state.mkdir(parents=True, exist_ok=True)
        fd = open(self.state / ".lock", "w")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fd.close()
            raise ClusterError(f"another `up` or `down` is working on {self.state} right now") from None
        return fd

    # --- up --------------------------------------------------------------------------------
    def up(self) -> float:
        """Start everything; returns the seconds the start took (after any binary build)."""
        lock = self._lock()
        try:
            running = self.running_processes()
            if running:
                rec = self.record()
                names = ", ".join(f"{p['name']} (pid {p['pid']})" for p in running)
                raise ClusterError(
                    f"a cluster is already running from {self.state}: {names}; apiserver {rec['server']}.\n"
                    f"Use it (eval \"$(e2e/cluster.sh env --state-dir {self.state})\") or stop it first "
                    f"(e2e/cluster.sh down --state-dir {self.state}).")
            bin_dir = build_binaries()
            started = time.monotonic()
            self._reset_state()
            try:
                self._start_all(bin_dir)
            except BaseException:
                say("start failed; stopping what was started")
                self._stop_all()
                raise
            took = time.monotonic() - started
            say(f"cluster up in {took:.1f}s: export KUBECONFIG={self.kubeconfig}")
            return took
        finally:
            lock.close()

    def _reset_state(self) -> None:
        """Empty the state dir of a previous run; refuse a directory that was never one."""
        marker = self.state / ".pagefleet-e2e-state"
        foreign = [c.name for c in self.state.iterdir() if c.name != ".lock"]
        if foreign and not marker.exists():
            raise ClusterError(f"{self.state} is not empty and is not an e2e state dir; pick another --state-dir")
        for child in self.state.iterdir():
            if child.name != ".lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        self.logs_dir.mkdir()
        marker.write_text("state of a pagefleet e2e cluster (e2e/cluster.py); safe to delete when it is down\n")

    def _start_all(self, bin_dir: Path) -> None:
        ports = {name: control_plane.free_port()
                 for name in ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler")}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        pki = certs.make_pki(self.state / "pki")
        tokens = control_plane.write_credentials(self.state, server, pki["ca_crt"])
        rec = {"server": server, "bin_dir": str(bin_dir), "ports": ports, "processes": []}
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("KUBECONFIG", None)
        for comp in control_plane.components(bin_dir, self.state, pki, ports, tokens["admin"]):
            t0 = time.monotonic()
            log = open(self.logs_dir / f"{comp.name}.log", "ab")
            # Own session: survives the `up` command, and `down` can signal its whole group.
            proc = subprocess.Popen(comp.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=self.state, start_new_session=True,
                                    preexec_fn=self._death_signal(comp.name))
            log.close()
            rec["processes"].append({"name": comp.name, "pid": proc.pid,
                                     "start_time": process_start_time(proc.pid)})
            self.record_path.write_text(json.dumps(rec, indent=1))
            while not comp.healthy():
                if proc.poll() is not None:
                    raise ClusterError(f"{comp.name} exited with {proc.returncode}:\n{self.log_tail(comp.name)}")
                if time.monotonic() - t0 > COMPONENT_TIMEOUT:
                    raise ClusterError(f"{comp.name} not healthy after {COMPONENT_TIMEOUT:.0f}s:\n"
                                       f"{self.log_tail(comp.name)}")
                time.sleep(0.25)
            say(f"{comp.name} ready in {time.monotonic() - t0:.1f}s (pid {proc.pid})")

    def _death_signal(self, name: str):
        """With die_with_parent: SIGTERM for the node agent (it stops its pods), SIGKILL for the
        rest (a SIGTERMed apiserver waits forever for an etcd that died beside it)."""
        if not self.die_with_parent:
            return None
        return _die_with_parent(signal.SIGTERM if name == "node-agent" else signal.SIGKILL)

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.logs_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- down ------------------------------------------------------------------------------
    def down(self) -> None:
        lock = self._lock()
        try:
            self._stop_all()
        finally:
            lock.close()

    def _stop_all(self) -> None:
        rec = self.record() or {"processes": []}
        # Reverse start order: the node agent first (it stops the pods), etcd last.
        for p in reversed(rec["processes"]):
            grace = 20.0 if p["name"] == "node-agent" else 10.0
            if _stop_process(p["pid"], p["start_time"], grace):
                say(f"stopped {p['name']} (pid {p['pid']})")
        # Pod processes the agent could not stop (it was killed, or crashed) still have pid files.
        for pid_file in (self.state / "pods").glob("*/*.pid") if (self.state / "pods").exists() else []:
            try:
                pid, start_time = pid_file.read_text().split()
            except (OSError, ValueError):
                continue
            if _stop_process(int(pid), start_time, 2.0):
                say(f"stopped leftover pod process {pid_file.parent.name}/{pid_file.stem} (pid {pid})")
        self.record_path.unlink(missing_ok=True)


def _stop_process(pid: int, start_time: str | None, grace: float) -> bool:
    """SIGTERM the process group, wait up to grace seconds, then SIGKILL. False if already gone."""
    if not _alive(pid, start_time):
        return False
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid, start_time) or _zombie(pid):
                return True
            time.sleep(0.1)
    return True


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pagefleet e2e Kubernetes cluster on loopback")
    p.add_argument("command", choices=["up", "down", "env", "status"])
    p.add_argument("--state-dir", default=os.environ.get("PAGEFLEET_E2E_STATE_DIR", str(DEFAULT_STATE_DIR)))
    args = p.parse_args(argv)
    cluster = Cluster(args.state_dir)
    try:
        if args.command == "up":
            cluster.up()
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.command == "down":
            cluster.down()
        elif args.command == "env":
            for key, value in cluster.env().items():
                print(f"export {key}={shlex.quote(value)}")
        else:
            running = cluster.running_processes()
            for proc in running:
                print(f"{proc['name']}\tpid {proc['pid']}")
            return 0 if running else 1
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
