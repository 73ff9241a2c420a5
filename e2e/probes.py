"""Container probes as the kubelet runs them: httpGet, tcpSocket and exec, with thresholds.

A ProbeState tracks one probe of one container: when it is next due, consecutive successes and
failures, and the verdict (success/failure thresholds applied, Kubernetes defaults).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.error
import urllib.request


def resolve_port(port, container: dict) -> int:
    """A probe port is a number or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a container port name")


def run_probe(probe: dict, container: dict, pod_ip: str, env: dict[str, str]) -> tuple[bool, str]:
    """One probe attempt; returns (success, message)."""
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            host = get.get("host") or pod_ip
            url = f"{scheme}://{host}:{resolve_port(get['port'], container)}{get.get('path', '/')}"
            req = urllib.request.Request(url, headers={h["name"]: h["value"] for h in get.get("httpHeaders", [])})
            # Like the kubelet: HTTPS probes do not verify the certificate.
            ctx = ssl._create_unverified_context() if scheme == "https" else None
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
                ok = 200 <= resp.status < 400
                return ok, f"HTTP {resp.status}"
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            host = tcp.get("host") or pod_ip
            with socket.create_connection((host, resolve_port(tcp["port"], container)), timeout=timeout):
                return True, "connected"
        if "exec" in probe:
            done = subprocess.run(probe["exec"]["command"], env=env, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return done.returncode == 0, f"exit {done.returncode}"
        if "grpc" in probe:
            # No gRPC health client here: a listening port is the closest local stand-in.
            with socket.create_connection((pod_ip, int(probe["grpc"]["port"])), timeout=timeout):
                return True, "grpc port open"
    except urllib.error.HTTPError as err:
        return False, f"HTTP {err.code}"
    except (OSError, ValueError, subprocess.TimeoutExpired) as err:
        return False, f"{type(err).__name__}: {err}"
    return False, "probe has no handler"


class ProbeState:
    """Thresholded verdict of one probe. `verdict` is None until the first attempt counts."""

    def __init__(self, kind: str, probe: dict, started_at: float):
        self.kind = kind
        self.probe = probe
        self.period = probe.get("periodSeconds", 10)
        self.success_threshold = probe.get("successThreshold", 1)
        self.failure_threshold = probe.get("failureThreshold", 3)
        self.next_due = started_at + probe.get("initialDelaySeconds", 0)
        self.successes = 0
        self.failures = 0
        self.verdict: bool | None = None
        self.message = ""

    def due(self, now: float) -> bool:
        return now >= self.next_due

    def observe(self, ok: bool, message: str, now: float) -> None:
        self.next_due = now + self.period
        self.message = message
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.success_threshold:
                self.verdict = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.failure_threshold:
                self.verdict = False


def probe_states(container: dict, started_at: float) -> dict[str, ProbeState]:
    """The container's startup/readiness/liveness probes, fresh for a (re)started process."""
    states = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if container.get(kind):
            states[kind] = ProbeState(kind, container[kind], started_at)
    return states
