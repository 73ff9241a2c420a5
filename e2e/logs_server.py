"""The part of the kubelet API that `kubectl logs` needs: GET /containerLogs/<ns>/<pod>/<container>.

The apiserver reaches it at the Node's InternalIP and daemonEndpoints port over HTTPS, presenting
its --kubelet-client-certificate; we accept only clients with a certificate from the cluster CA.
Supported query parameters: follow, tailLines, limitBytes, previous (ignored: one file holds
every run of the container, each start marked by a '--- <time> starting' line).
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

log = logging.getLogger("node-agent")

_PATH = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/]+)$")


def tail_lines(data: bytes, n: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:]) if n > 0 else b""


def make_handler(agent):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # keep the agent's log for pod events
            pass

        def do_GET(self):
            url = urlparse(self.path)
            if url.path in ("/healthz", "/readyz"):
                return self._reply(200, b"ok")
            m = _PATH.match(url.path)
            if not m:
                return self._reply(404, b"not found")
            namespace, name, container = m.groups()
            runtime = agent.find(namespace, name)
            if runtime is None:
                return self._reply(404, f"pod {namespace}/{name} is not on this node".encode())
            path = runtime.log_path(container)
            if not path.exists():
                return self._reply(404, f"no logs for container {container}".encode())
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            data = path.read_bytes()
            if "tailLines" in query:
                data = tail_lines(data, int(query["tailLines"]))
            if "limitBytes" in query:
                data = data[: int(query["limitBytes"])]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            if query.get("follow") != "true":
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.end_headers()
            self._follow(path, data, runtime)

        def _follow(self, path, first: bytes, runtime):
            """Stream what the file gains until the pod's processes are gone or the client leaves."""
            try:
                self.wfile.write(first)
                self.wfile.flush()
                offset = path.stat().st_size
                while runtime.thread.is_alive():
                    time.sleep(0.5)
                    with open(path, "rb") as f:
                        f.seek(offset)
                        more = f.read()
                    if more:
                        offset += len(more)
                        self.wfile.write(more)
                        self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        def _reply(self, code: int, body: bytes):
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def serve(agent, args) -> ThreadingHTTPServer:
    """Start the HTTPS server on 127.0.0.1; sets args.kubelet_port when it was 0."""
    server = ThreadingHTTPServer(("127.0.0.1", args.kubelet_port), make_handler(agent))
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    ctx.load_verify_locations(args.ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    args.kubelet_port = server.server_address[1]
    threading.Thread(target=server.serve_forever, name="logs-server", daemon=True).start()
    log.info("container logs served on https://127.0.0.1:%d", args.kubelet_port)
    return server
