"""How each component of the e2e cluster is configured: credentials, kubeconfigs, command lines,
and the health check that says it is up. Everything listens on 127.0.0.1, on free ports, so
several clusters (one per pytest session, plus a developer's) can run side by side.
"""

from __future__ import annotations

import secrets
import socket
import ssl
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
NODE_NAME = "pagefleet-node"
SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port no other caller in this process got: a port is found by binding port 0 and
    closing the socket, and until its server binds it the OS may hand it out again."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass
class Component:
    name: str
    argv: list[str]
    healthy: Callable[[], bool]


def kubeconfig_text(server: str, ca_file: Path, user: str, token: str) -> str:
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: pagefleet-e2e\n  cluster:\n    server: {server}\n"
        f"    certificate-authority: {ca_file}\n"
        f"users:\n- name: {user}\n  user:\n    token: {token}\n"
        f"contexts:\n- name: pagefleet-e2e\n  context:\n    cluster: pagefleet-e2e\n    user: {user}\n"
        "current-context: pagefleet-e2e\n"
    )


def write_credentials(state: Path, server: str, ca_file: Path) -> dict[str, str]:
    """Static bearer tokens (--token-auth-file) and one kubeconfig per client identity."""
    identities = {
        # name: (user, groups)
        "admin": ("pagefleet-admin", "system:masters"),
        "kube-controller-manager": ("system:kube-controller-manager", ""),
        "kube-scheduler": ("system:kube-scheduler", ""),
        # The Node authorizer + NodeRestriction limit the agent to its own node and pods.
        "node-agent": (f"system:node:{NODE_NAME}", "system:nodes"),
    }
    tokens = {name: secrets.token_hex(24) for name in identities}
    lines = [f'{tokens[n]},{user},{n},"{groups}"' for n, (user, groups) in identities.items()]
    (state / "tokens.csv").write_text("\n".join(lines) + "\n")
    (state / "tokens.csv").chmod(0o600)
    for name, (user, _) in identities.items():
        path = state / ("kubeconfig" if name == "admin" else f"{name}.kubeconfig")
        path.write_text(kubeconfig_text(server, ca_file, user, tokens[name]))
        path.chmod(0o600)
    (state / "node-agent.token").write_text(tokens["node-agent"])
    (state / "node-agent.token").chmod(0o600)
    return tokens


def _tls(ca_file: str | None):
    """httpx verify= value: the cluster CA, or no verification (components' self-signed certs)."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else False


def _http_ok(url: str, verify, token: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return httpx.get(url, verify=_tls(verify or None), headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def components(bin_dir: Path, state: Path, pki: dict[str, Path], ports: dict[str, int],
               admin_token: str) -> list[Component]:
    """The control plane in start order; each waits for the one before it to be healthy."""
    b = lambda name: str(bin_dir / name)  # noqa: E731
    api = f"https://127.0.0.1:{ports['apiserver']}"
    ca = str(pki["ca_crt"])
    etcd = Component("etcd", [
        b("etcd"), "--name=pagefleet-e2e", f"--data-dir={state / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
        f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
        f"--listen-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd_peer']}",
        f"--initial-cluster=pagefleet-e2e=http://127.0.0.1:{ports['etcd_peer']}",
        "--unsafe-no-fsync",  # a throwaway test store: durability buys nothing, fsyncs cost a lot
        "--log-level=warn",
    ], lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health", False))
    apiserver = Component("kube-apiserver", [
        b("kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
        f"--tls-cert-file={pki['apiserver_crt']}", f"--tls-private-key-file={pki['apiserver_key']}",
        f"--client-ca-file={ca}",
        f"--token-auth-file={state / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki['sa_pub']}",
        f"--service-account-signing-key-file={pki['sa_key']}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        # `kubectl logs`: the apiserver calls the node agent's HTTPS endpoint (logs_server.py).
        f"--kubelet-client-certificate={pki['kubelet_client_crt']}",
        f"--kubelet-client-key={pki['kubelet_client_key']}",
        f"--kubelet-certificate-authority={ca}",
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false", "--v=1",
    ], lambda: _http_ok(f"{api}/readyz", ca, admin_token))
    controller_manager = Component("kube-controller-manager", [
        b("kube-controller-manager"),
        f"--kubeconfig={state / 'kube-controller-manager.kubeconfig'}",
        "--bind-address=127.0.0.1", f"--secure-port={ports['controller_manager']}",
        "--controllers=*",
        f"--service-account-private-key-file={pki['sa_key']}",
        f"--root-ca-file={ca}",
        "--use-service-account-credentials=true",
        f"--cluster-signing-cert-file={ca}", f"--cluster-signing-key-file={pki['ca_key']}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--leader-elect=false", "--profiling=false", "--v=1",
    ], lambda: _http_ok(f"https://127.0.0.1:{ports['controller_manager']}/healthz", False))
    scheduler = Component("kube-scheduler", [
        b("kube-scheduler"),
        f"--kubeconfig={state / 'kube-scheduler.kubeconfig'}",
        "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
        "--leader-elect=false", "--profiling=false", "--v=1",
    ], lambda: _http_ok(f"https://127.0.0.1:{ports['scheduler']}/healthz", False))
    agent = Component("node-agent", [
        sys.executable, str(HERE / "node_agent.py"),
        f"--server={api}", f"--apiserver-port={ports['apiserver']}",
        f"--token-file={state / 'node-agent.token'}", f"--ca-file={ca}",
        f"--node-name={NODE_NAME}", f"--state-dir={state}",
        f"--tls-cert={pki['agent_crt']}", f"--tls-key={pki['agent_key']}",
    ], lambda: _node_ready(api, ca, admin_token))
    return [etcd, apiserver, controller_manager, scheduler, agent]


def _node_ready(api: str, ca: str, token: str) -> bool:
    """The node is Ready and pods can be created (the default ServiceAccount exists)."""
    headers = {"Authorization": f"Bearer {token}"}
    try:
        node = httpx.get(f"{api}/api/v1/nodes/{NODE_NAME}", verify=_tls(ca), headers=headers, timeout=2)
        sa = httpx.get(f"{api}/api/v1/namespaces/default/serviceaccounts/default",
                       verify=_tls(ca), headers=headers, timeout=2)
    except httpx.HTTPError:
        return False
    if node.status_code != 200 or sa.status_code != 200:
        return False
    conditions = node.json().get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
