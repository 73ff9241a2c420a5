"""What a pod's container sees when the node agent runs it as a local process: argv, env, cwd.

Kubernetes semantics kept: `env` in order with `$(VAR)` expansion against earlier entries
(`$$(VAR)` escapes, unknown references stay literal), `valueFrom.fieldRef` (downward API),
`configMapKeyRef`/`secretKeyRef`, `envFrom`, and `$(VAR)` expansion in command/args.
Local-process limits (documented in e2e/README.md): the image is ignored and the command runs from
this machine's installed software; container mountPaths are not remapped. hostPath volumes work
when mountPath == path (same files); emptyDir gets a fresh directory whose path is exported as
PAGEFLEET_VOLUME_<NAME>; every other volume is skipped.
"""

from __future__ import annotations

import base64
import os
import re
import stat
from pathlib import Path

from kube_http import ApiError, KubeHTTP

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined vars are substituted, $$ is a literal $."""

    def repl(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(repl, text)


def field_value(pod: dict, field_path: str) -> str:
    """The downward API fields a pod's env can reference (status.podIP etc.)."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if field_path in simple:
        return simple[field_path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path)
    if m:
        return meta.get(m.group(1), {}).get(m.group(2), "")
    if field_path == "status.podIPs":
        return ",".join(ip["ip"] for ip in status.get("podIPs", []))
    raise ValueError(f"unsupported fieldRef {field_path!r}")


def _read_key(api: KubeHTTP, kind: str, namespace: str, ref: dict) -> str | None:
    """One key of a ConfigMap or Secret; None when optional and missing."""
    path = f"/api/v1/namespaces/{namespace}/{kind}/{ref['name']}"
    try:
        obj = api.get(path)
    except ApiError as err:
        if err.status == 404 and ref.get("optional"):
            return None
        raise
    if kind == "secrets":
        raw = obj.get("data", {}).get(ref["key"])
        value = None if raw is None else base64.b64decode(raw).decode()
    else:
        value = obj.get("data", {}).get(ref["key"])
    if value is None and not ref.get("optional"):
        raise KeyError(f"{kind}/{ref['name']} has no key {ref['key']!r}")
    return value


def _env_from(api: KubeHTTP, namespace: str, sources: list[dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in sources:
        prefix = src.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            if key not in src:
                continue
            ref = src[key]
            try:
                data = api.get(f"/api/v1/namespaces/{namespace}/{kind}/{ref['name']}").get("data", {})
            except ApiError as err:
                if err.status == 404 and ref.get("optional"):
                    continue
                raise
            for k, v in data.items():
                env[prefix + k] = base64.b64decode(v).decode() if kind == "secrets" else v
    return env


def container_env(api: KubeHTTP, pod: dict, container: dict, base: dict[str, str]) -> dict[str, str]:
    """base (the agent's own environment plus cluster variables), then envFrom, then env."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    env.update(_env_from(api, namespace, container.get("envFrom", [])))
    for var in container.get("env", []):
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configmaps" if "configMapKeyRef" in source else "secrets"
            value = _read_key(api, kind, namespace, source.get("configMapKeyRef") or source["secretKeyRef"])
            if value is not None:
                env[name] = value
        elif "resourceFieldRef" in source:
            env[name] = "0"  # limits are not enforced on local processes
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expansion. No image entrypoint exists, so a container needs one."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if not argv:
        raise ValueError(f"container {container['name']!r} has no command/args (images are ignored)")
    return [expand(a, env) for a in argv]


_HOSTPATH_CHECKS = {  # the kubelet's hostPath type checks that a local process can honour
    "Directory": (os.path.isdir, "is not a directory"),
    "File": (os.path.isfile, "is not a file"),
    "Socket": (lambda p: os.path.exists(p) and stat.S_ISSOCK(os.stat(p).st_mode), "is not a socket"),
}


def hostpath_mount_failures(pod: dict) -> list[str]:
    """FailedMount messages, worded as the kubelet words them, for hostPath volumes whose type check fails."""
    failures = []
    for vol in pod["spec"].get("volumes", []):
        host = vol.get("hostPath")
        check = _HOSTPATH_CHECKS.get((host or {}).get("type", ""))
        if check and not check[0](host["path"]):
            failures.append(f'MountVolume.SetUp failed for volume "{vol["name"]}" : hostPath type check failed: '
                            f'{host["path"]} {check[1]}')
    return failures


def prepare_volumes(pod: dict, pod_dir: Path) -> dict[str, str]:
    """Create emptyDirs under pod_dir; return env entries naming them (PAGEFLEET_VOLUME_<NAME>)."""
    env = {}
    for vol in pod["spec"].get("volumes", []):
        if "emptyDir" in vol:
            path = pod_dir / "volumes" / vol["name"]
            path.mkdir(parents=True, exist_ok=True)
            env["PAGEFLEET_VOLUME_" + re.sub(r"[^A-Za-z0-9]", "_", vol["name"]).upper()] = str(path)
    return env


def working_dir(container: dict, pod_dir: Path) -> str:
    wd = container.get("workingDir")
    return wd if wd and os.path.isdir(wd) else str(pod_dir)


def service_account_kubeconfig(api: KubeHTTP, pod: dict, pod_dir: Path, ca_file: str) -> str | None:
    """A kubeconfig holding a TokenRequest token of the pod's service account, bound to the pod.

    In-cluster clients read /var/run/secrets/..., which a local process cannot have; exporting
    KUBECONFIG pointing here lets them (kopf, the kubernetes client) act with the pod's RBAC.
    """
    spec, meta = pod["spec"], pod["metadata"]
    if spec.get("automountServiceAccountToken") is False:
        return None
    sa = spec.get("serviceAccountName") or "default"
    request = {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": 86400,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]},
        },
    }
    token = api.create(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", request)
    token = token["status"]["token"]
    sa_dir = pod_dir / "serviceaccount"
    sa_dir.mkdir(parents=True, exist_ok=True)
    (sa_dir / "token").write_text(token)
    (sa_dir / "namespace").write_text(meta["namespace"])
    (sa_dir / "ca.crt").write_bytes(Path(ca_file).read_bytes())
    kubeconfig = sa_dir / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: e2e\n  cluster:\n    server: {api.server}\n"
        f"    certificate-authority: {sa_dir / 'ca.crt'}\n"
        f"users:\n- name: {sa}\n  user:\n    tokenFile: {sa_dir / 'token'}\n"
        f"contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {sa}\n"
        f"    namespace: {meta['namespace']}\ncurrent-context: e2e\n"
    )
    return str(kubeconfig)
