"""The queue-depth autoscaling decision, with a fake clock (no cluster, no pods)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagefleet.operator import autoscaler

BOUNDS = dict(target=4, min_replicas=1, max_replicas=4, scale_down_delay=60)


def step(current, waiting, now, low_since=None, **overrides):
    args = {**BOUNDS, **overrides}
    return autoscaler.decide(current=current, waiting=waiting, now=now, low_since=low_since, **args)


def test_scale_up_is_immediate_and_sized_by_total_queue():
    d = step(1, [13], now=0)
    assert d.changed and d.reason == autoscaler.SCALE_UP
    assert d.replicas == 4  # ceil(13 / 4)
    assert d.average == 13


def test_scale_up_is_capped_at_max_replicas():
    d = step(2, [50, 50], now=0)
    assert d.replicas == 4 and d.needed == 4


def test_load_at_target_holds():
    d = step(2, [4, 3], now=0)
    assert not d.changed and d.reason == "AtTarget" and d.low_since is None


def test_scale_down_waits_for_the_delay_of_continuous_low_load():
    d = step(4, [0, 0, 1, 0], now=100)
    assert not d.changed and d.reason == "LowLoad" and d.low_since == 100
    d = step(4, [0, 0, 0, 0], now=130, low_since=d.low_since)
    assert not d.changed and d.low_since == 100
    d = step(4, [0, 0, 0, 0], now=160, low_since=d.low_since)
    assert d.changed and d.reason == autoscaler.SCALE_DOWN and d.replicas == 1
    assert d.low_since is None


def test_a_busy_sample_resets_the_scale_down_clock():
    d = step(3, [0, 0, 0], now=0)
    assert d.low_since == 0
    d = step(3, [4, 4, 4], now=50, low_since=d.low_since)
    assert d.low_since is None and not d.changed
    d = step(3, [0, 0, 0], now=70, low_since=d.low_since)
    assert d.low_since == 70 and not d.changed


def test_scale_down_never_goes_below_min_replicas():
    d = step(3, [0, 0, 0], now=1000, low_since=0, min_replicas=2)
    assert d.replicas == 2


def test_zero_delay_scales_down_at_once():
    d = step(4, [1, 0, 0, 0], now=5, scale_down_delay=0)
    assert d.changed and d.replicas == 1


def test_out_of_bounds_is_corrected_at_once():
    assert step(1, [], now=0, min_replicas=2).replicas == 2
    assert step(7, [0], now=0).replicas == 4
    up = step(1, [20], now=0, min_replicas=2)
    assert up.replicas == 4 and up.reason == autoscaler.SCALE_UP


def test_no_samples_holds_and_keeps_no_low_load_clock():
    d = step(3, [], now=10, low_since=0)
    assert not d.changed and d.average is None and d.low_since is None


def test_fractional_target():
    d = step(1, [1], now=0, target=0.5)
    assert d.replicas == 2


class _LoadHandler(BaseHTTPRequestHandler):
    answers = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        body = self.answers.get(port)
        if self.path != "/load" or body is None:
            self.send_response(503)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def load_servers():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _LoadHandler) for _ in range(3)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def test_probe_reads_waiting_from_each_pod_and_skips_failures(load_servers):
    a, b, broken = (s.server_address[1] for s in load_servers)
    _LoadHandler.answers = {
        a: {"waiting": 7, "running": 8, "kv_cache_usage": 0.5, "max_num_seqs": 8},
        b: {"waiting": 0, "running": 1, "kv_cache_usage": 0.1, "max_num_seqs": 8},
    }
    closed = "http://127.0.0.1:9"  # nothing listens on the discard port
    urls = [f"http://127.0.0.1:{a}", f"http://127.0.0.1:{b}", f"http://127.0.0.1:{broken}", closed]
    waiting = asyncio.run(autoscaler.probe_waiting(urls, timeout=2.0))
    assert waiting == {f"http://127.0.0.1:{a}": 7, f"http://127.0.0.1:{b}": 0}
