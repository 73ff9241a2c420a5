"""A real `pagefleet serve` process for the tests that need one: started on a free loopback port, ready when
`/ready` answers, with the API key its clients send (tests/entrypoints, tests/models, tests/operator)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai

from ports import free_port

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Server:
    def __init__(self, log_path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "pagefleet", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", KEY, "--served-model-name", "smol", *flags]
        # cwd away from the repository root, whose operator/ folder would shadow the standard library's
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=log_path.parent)
        deadline = time.time() + 600  # the first start converts the bundled model
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def aclient(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def load(self) -> dict:
        return httpx.get(self.url + "/load").json()
