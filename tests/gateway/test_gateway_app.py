"""`pagefleet gateway` flags (clear errors for bad input) and its readiness gate."""

import argparse
import os
import re
import subprocess
import sys

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagefleet.gateway import app as gateway_app


def parse(*argv):
    parser = argparse.ArgumentParser()
    gateway_app.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    ((), "--master-key"),
    (("--master-key", "sk-x"), "either --worker"),
    (("--master-key", "sk-x", "--worker", "http://a:1", "--kubernetes"), "either --worker"),
    (("--master-key", "sk-x", "--worker", "http://a:1"), "--served-model-name"),
    (("--master-key", "sk-x", "--worker", "a:1", "--served-model-name", "m"), "worker URL"),
    (("--master-key", "hunter2", "--worker", "http://a:1", "--served-model-name", "m"), "sk-"),
    (("--master-key", "sk-x", "--kubernetes", "--kv-threshold", "1.5"), "kv_threshold"),
    (("--master-key", "sk-x", "--kubernetes", "--probe-interval-ms", "0"), "probe interval"),
])
def test_bad_flags_are_clear_errors(argv, message, monkeypatch):
    monkeypatch.delenv("PAGEFLEET_MASTER_KEY", raising=False)
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    args = parse(*argv)
    with pytest.raises(SystemExit, match=re.escape(message)):
        gateway_app._validate(args)


def test_good_flags():
    settings, policy, workers = gateway_app._validate(parse(
        "--master-key", "sk-x", "--worker", "http://127.0.0.1:8001/", "--worker", "http://127.0.0.1:8002",
        "--served-model-name", "smol", "--queue-threshold", "3", "--routing", "simple-shuffle"))
    assert workers == [("smol", "http://127.0.0.1:8001"), ("smol", "http://127.0.0.1:8002")]
    assert policy.queue_threshold == 3 and settings.routing_strategy == "simple-shuffle"


async def test_readiness_is_503_until_the_strategy_is_installed():
    inner = Starlette(routes=[Route("/health/readiness", lambda r: PlainTextResponse("ok"))])
    gate = gateway_app.NotReadyUntilRouting(inner)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gw") as c:
        assert (await c.get("/health/readiness")).status_code == 503
        gate.ready = True
        assert (await c.get("/health/readiness")).text == "ok"


def test_gateway_never_imports_torch_or_the_worker(tmp_path):
    """The gateway's image has no torch: neither our modules nor the LiteLLM proxy may pull it in."""
    code = ("import sys\n"
            "import pagefleet.gateway.app, pagefleet.gateway.strategy, pagefleet.gateway.membership\n"
            "from litellm.proxy import proxy_server\n"
            "bad = [m for m in sys.modules\n"
            "       if m == 'torch' or m.startswith(('pagefleet.worker', 'pagefleet.kernels'))]\n"
            "print(bad)\n")
    # cwd outside the checkout: its top-level operator/ would shadow the standard library's operator.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
