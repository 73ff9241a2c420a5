"""The gateway end to end on loopback: the real LiteLLM proxy (`pagefleet gateway`) in front of two real
`pagefleet serve` workers on the bundled model, driven by the real `openai` client.

Two gateways over the same two workers: `ours` (queue-depth routing) and `shuffle` (LiteLLM's own
simple-shuffle), so both strategies meet the same load in the same run. LiteLLM answers with the
header x-litellm-model-api-base, which says which worker served each request. One file past 300 lines: the
workers and gateways start once for every test here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ports import free_port

pytestmark = pytest.mark.slow

MODEL = "smol"
MASTER_KEY = "sk-pagefleet-e2e"
WORKER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "2", "--max-queue", "64"]
# Long requests sent straight to one worker: 2 running, 8 waiting. Its queue stays deeper than the idle
# worker's would be after the whole burst, so sending the burst there is right by queue depth alone.
BUSY_REQUESTS = 10
ROUNDS = 3  # bursts per strategy, pooled
BURST = 6


class Proc:
    """A child process with its log, started by the command and ready when `ready_path` answers 200."""

    def __init__(self, log_path, cmd: list[str], port: int, ready_path: str):
        self.cmd, self.port, self.ready_path, self.log_path = cmd, port, ready_path, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.start()

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        # One thread each: the machine is small and shared, and two workers must not fight over cores.
        env = dict(os.environ, OMP_NUM_THREADS="1", LITELLM_LOCAL_MODEL_COST_MAP="True")
        # cwd outside the checkout: its top-level operator/ would shadow the standard library's operator.
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.log_path.parent)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout  # the first worker start converts the bundled model
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[2:4]} exited {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"not ready:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def worker(tmp, i: int) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pagefleet", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL, *WORKER_FLAGS]
    return Proc(tmp / f"worker{i}.log", cmd, port, "/ready")


def gateway(tmp, name: str, workers: list[Proc], routing: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pagefleet", "gateway", "--host", "127.0.0.1", "--port", str(port),
           "--master-key", MASTER_KEY, "--served-model-name", MODEL, "--routing", routing,
           "--probe-interval-ms", "100", *[a for w in workers for a in ("--worker", w.url)]]
    return Proc(tmp / f"gateway-{name}.log", cmd, port, "/health/readiness")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-e2e")
    workers = [worker(tmp, 0), worker(tmp, 1)]
    gateways = {"ours": gateway(tmp, "ours", workers, "queue-depth"),
                "shuffle": gateway(tmp, "shuffle", workers, "simple-shuffle")}
    procs = workers + list(gateways.values())
    try:
        for p in procs:  # started together, waited for in turn: the starts overlap
            p.wait_ready()
        yield workers, gateways
    finally:
        for p in procs:  # told together, waited for in turn: the shutdowns overlap too
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs:
            p.stop()


def aclient(gw: Proc, key: str = MASTER_KEY) -> openai.AsyncOpenAI:
    # Generous timeout: the machine is small and shared, and under shuffle part of a burst waits long.
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=600)


def served_by(raw) -> str:
    return raw.headers["x-litellm-model-api-base"].removesuffix("/v1")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# ---- 1. the OpenAI API through the gateway, and its key ----

async def test_chat_and_completion_streamed_and_not(fleet):
    _, gateways = fleet
    c = aclient(gateways["ours"])
    messages = [{"role": "user", "content": "Say hello."}]
    chat = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 8
    comp = await c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 6

    stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    pieces = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(pieces) == chat.choices[0].message.content  # greedy: same text either way
    stream = await c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                        stream=True)
    text = "".join([ch.choices[0].text or "" async for ch in stream if ch.choices])
    assert text == comp.choices[0].text

    models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_wrong_or_missing_key_is_401_and_health_is_open(fleet):
    _, gateways = fleet
    gw = gateways["ours"]
    with pytest.raises(openai.AuthenticationError):
        await aclient(gw, key="sk-wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    async with httpx.AsyncClient(base_url=gw.url) as h:
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        r = await h.post("/v1/chat/completions", json={"model": MODEL, "messages": []},
                         headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401
        assert (await h.get("/health/liveliness")).status_code == 200
        assert (await h.get("/health/readiness")).status_code == 200
        metrics = (await h.get("/pagefleet/metrics")).text
        assert "pagefleet_gateway_worker_up" in metrics and "pagefleet_gateway_routing_decisions_total" in metrics


def _get_twice_on_one_connection(url: str, path: str, idle_s: float) -> tuple[bytes, bytes]:
    """Two GETs on one keep-alive socket, `idle_s` apart: the status lines (b"" once the server has closed)."""
    host, port = url.removeprefix("http://").split(":")
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as f:
        lines = []
        for i in range(2):
            time.sleep(idle_s if i else 0)
            try:
                sock.sendall(request)
                status = f.readline()
            except OSError:  # reset by a server that closed the connection
                status = b""
            lines.append(status)
            length = 0
            while (header := f.readline()) not in (b"\r\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            f.read(length)
    return lines[0], lines[1]


def test_idle_keep_alive_connections_outlive_client_pools(fleet):
    """A connection idle past httpx's and the openai SDK's 5 s expiry is still open on both servers: the client
    closes it first, so no request is ever written into a connection the server is closing."""
    workers, gateways = fleet
    targets = ((gateways["ours"].url, "/health/liveliness"), (workers[0].url, "/load"))
    with ThreadPoolExecutor(len(targets)) as pool:  # both idle at once: one 6 s wait, not two
        results = list(pool.map(lambda t: _get_twice_on_one_connection(*t, idle_s=6.0), targets))
    for (url, _), (first, second) in zip(targets, results):
        assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), (url, first, second)


# ---- 2. queue-depth routing against simple-shuffle, same load, same run ----

async def _gateway_sees_waiting(h: httpx.AsyncClient, gw: Proc, worker: Proc) -> float:
    """The waiting requests the gateway's last probe of `worker` found (its pagefleet_gateway_worker_waiting)."""
    text = (await h.get(gw.url + "/pagefleet/metrics")).text
    prefix = f'pagefleet_gateway_worker_waiting{{worker="{worker.url}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


async def _burst_while_busy(busy: Proc, gw: Proc) -> tuple[list[float], list[str]]:
    """Keeps `busy` full with long requests sent to it directly, then sends a burst through `gw`."""
    async with httpx.AsyncClient(timeout=600) as h:
        body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 12,
                "ignore_eos": True, "temperature": 0}
        long_ones = [asyncio.create_task(h.post(busy.url + "/v1/completions", json=body))
                     for _ in range(BUSY_REQUESTS)]
        while (await h.get(busy.url + "/load")).json()["waiting"] < BUSY_REQUESTS - 2:
            await asyncio.sleep(0.05)
        # The gateway has seen the queue: its last probe of `busy` says so. A fixed wait of a few probe intervals
        # was not enough on a loaded 2-core CI machine, where a late probe let 6 of 18 through to `busy`.
        deadline = time.perf_counter() + 10.0
        while await _gateway_sees_waiting(h, gw, busy) < BUSY_REQUESTS - 2:
            assert time.perf_counter() < deadline, "the gateway's probes never saw the busy worker's queue"
            await asyncio.sleep(0.05)
        c = aclient(gw)

        async def one(i):
            start = time.perf_counter()
            raw = await c.completions.with_raw_response.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=2,
                                                               temperature=0)
            raw.parse()
            return time.perf_counter() - start, served_by(raw)

        results = await asyncio.gather(*(one(i) for i in range(BURST)))
        for r in await asyncio.gather(*long_ones):  # the busy worker drains before the next measurement
            assert r.status_code == 200
    return [t for t, _ in results], [w for _, w in results]


async def test_queue_depth_routing_beats_simple_shuffle(fleet):
    workers, gateways = fleet
    busy, idle = workers
    measured = {}
    for name in ("ours", "shuffle"):
        # Pooled over rounds: a single shuffled burst of 6 lands wholly on the idle worker one time in 64,
        # and then the two strategies tie; over 3 rounds that is one time in 2**18.
        latencies, to_idle = [], 0
        for _ in range(ROUNDS):
            times, where = await _burst_while_busy(busy, gateways[name])
            latencies += times
            to_idle += sum(w == idle.url for w in where)
        measured[name] = latencies
        total = ROUNDS * BURST
        print(f"\n{name:8s}: {ROUNDS} bursts of {BURST}, {to_idle} of {total} to the idle worker; latency p50 "
              f"{pct(latencies, 50):.2f} s, p99 {pct(latencies, 99):.2f} s, mean {statistics.mean(latencies):.2f} s")
        if name == "ours":
            why = await _decisions(gateways["ours"])  # on failure: the router's reasons, by worker
            assert to_idle >= total - ROUNDS, \
                f"queue-depth routing sent {total - to_idle} of {total} to the busy worker: {why}"
    ours, shuffle = measured["ours"], measured["shuffle"]
    # Ours may send up to ROUNDS requests to the busy worker (asserted above), and each of those waits as long
    # as shuffle's slowest: a p99 of 18 samples is their maximum, which one such request decides (CI saw
    # 2 of 18 and a lost p99 once). Compare just below that allowance: the 15th fastest of 18. Shuffle sends
    # 4 or more of 18 to the busy worker 99.6 % of the time, which makes its 15th fastest slow.
    k = ROUNDS * BURST - ROUNDS
    assert sorted(ours)[k - 1] < sorted(shuffle)[k - 1], f"busy {busy.url}, idle {idle.url}; decisions {why}"
    assert statistics.mean(ours) < statistics.mean(shuffle)


async def _decisions(gw: Proc) -> list[str]:
    """The gateway's routing decisions so far (worker, reason, count), from its metrics."""
    async with httpx.AsyncClient(base_url=gw.url) as h:
        text = (await h.get("/pagefleet/metrics")).text
    return [line for line in text.splitlines() if line.startswith("pagefleet_gateway_routing_decisions_total{")]


# ---- 3. a worker killed mid-run: no request lost; restarted, it rejoins ----

async def test_sigkill_loses_no_request_and_restarted_worker_rejoins(fleet):
    workers, gateways = fleet
    victim, survivor = workers
    outcomes: dict[str, list] = {"ours": [], "shuffle": []}

    async def run(name: str, n: int, stream: bool):
        c = aclient(gateways[name])
        for i in range(n):
            try:
                if stream:
                    s = await c.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=3, stream=True)
                    text = "".join([ch.choices[0].text or "" async for ch in s if ch.choices])
                else:
                    answer = await c.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=3)
                    text = answer.choices[0].text
                outcomes[name].append(("ok", text, stream))
            except Exception as exc:  # recorded, asserted below: a lost request fails the test
                outcomes[name].append(("lost", repr(exc), stream))

    runners = [asyncio.create_task(run(name, 5, stream=False)) for name in outcomes for _ in range(2)]
    await asyncio.sleep(2.0)
    victim.kill()
    killed_at = time.monotonic()
    await asyncio.gather(*runners)
    # Streams that begin after the kill: LiteLLM retries them on the survivor before any byte is sent.
    await asyncio.gather(*(run(name, 3, stream=True) for name in outcomes))
    for name, results in outcomes.items():
        assert len(results) == 2 * 5 + 3
        # ours: nothing lost. simple-shuffle: nothing lost of the requests in flight at the kill (the
        # router retries them), but a stream that starts after it may be sent to the dead worker: its
        # connection fails inside the stream, where LiteLLM neither retries nor cools the worker down
        # (CI lost all three of shuffle's streams once). Our probe takes the worker out within 100 ms.
        lost = [r for r in results if r[0] != "ok" and (name == "ours" or not r[2])]
        assert not lost, f"{name}: {len(lost)} of {len(results)} requests lost: {lost[:3]}"
    shuffle_streams_lost = sum(r[0] != "ok" for r in outcomes["shuffle"] if r[2])
    print(f"\nafter SIGKILL: {sum(map(len, outcomes.values()))} requests ({time.monotonic() - killed_at:.1f} s after "
          f"the kill); lost: none through ours, {shuffle_streams_lost} of 3 later streams through simple-shuffle")

    victim.start()  # same port: the static member comes back
    victim.wait_ready()
    assert await serves_again(gateways["ours"], victim.url), "the restarted worker did not get traffic again"
    async with httpx.AsyncClient() as h:
        metrics = (await h.get(gateways["ours"].url + "/pagefleet/metrics")).text
    assert f'pagefleet_gateway_worker_up{{worker="{victim.url}"}} 1.0' in metrics


async def serves_again(gw: Proc, url: str, timeout: float = 30) -> bool:
    """Sends small bursts through the gateway until the worker at url answers one."""
    c = aclient(gw)
    deadline = time.time() + timeout
    seen = set()
    while url not in seen and time.time() < deadline:
        raws = await asyncio.gather(*(c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
                                      for _ in range(4)))
        seen |= {served_by(r) for r in raws}
    return url in seen


# ---- 4. a draining worker answers 503: LiteLLM retries on the other one ----

async def test_draining_worker_503_is_retried_elsewhere(fleet):
    workers, gateways = fleet
    draining, other = workers
    draining.wait_ready()
    # The SIGKILL before may have left this worker in simple-shuffle's cooldown, where shuffle would never
    # pick it and so never need a retry (CI saw 0 retries once): start once shuffle sends it work again.
    assert await serves_again(gateways["shuffle"], draining.url), "simple-shuffle never sent the worker work again"
    async with httpx.AsyncClient(timeout=600) as h:
        # One long request keeps the worker draining (503 for new work) instead of exiting at once.
        long_one = asyncio.create_task(h.post(draining.url + "/v1/completions", json={
            "model": MODEL, "prompt": "Tell a long story.", "max_tokens": 24, "ignore_eos": True}))
        while (await h.get(draining.url + "/load")).json()["running"] < 1:
            await asyncio.sleep(0.05)
        draining.proc.send_signal(signal.SIGTERM)
        while (await h.get(draining.url + "/ready")).status_code != 503:
            await asyncio.sleep(0.05)
        refused = await h.post(draining.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503  # the worker does refuse: what follows is the gateway's doing

        async def one(name):
            raw = await aclient(gateways[name]).completions.with_raw_response.create(model=MODEL, prompt="Hi",
                                                                                     max_tokens=2)
            raw.parse()
            return served_by(raw), int(raw.headers.get("x-litellm-attempted-retries", 0))

        results = {name: await asyncio.gather(*(one(name) for _ in range(8))) for name in ("shuffle", "ours")}
        assert (await long_one).status_code == 200  # the drain let the in-flight request finish
    for name, answers in results.items():
        assert all(url == other.url for url, _ in answers), f"{name}: answered by the draining worker"
    retries = {name: [r for _, r in answers] for name, answers in results.items()}
    print(f"\nwhile draining, retries behind each answer: {retries}")
    # simple-shuffle picks the draining worker about half the time: those answers came from a retry.
    assert sum(retries["shuffle"]) >= 1
