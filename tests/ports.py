"""Loopback ports for the servers the tests start: the e2e harness's free_port (e2e/control_plane.py),
which never hands out the same port twice in one process.

Two workers of one test once got the same port (found by binding port 0, free again until the server
binds it after loading its model): one failed to bind, and the other answered both readiness checks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from control_plane import free_port  # noqa: E402, F401
