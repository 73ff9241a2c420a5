"""AsyncLLMEngine: the engine's step loop on its own thread, each request streaming through an asyncio queue.

The HTTP side never runs model code and the loop never waits on a client: adds and aborts cross
over in a thread-safe inbox, outputs come back with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.outputs import RequestOutput
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.engine.stats import EngineStats

log = logging.getLogger("pagefleet.engine")
IDLE_WAIT_S = 0.05
_ABORTED = object()  # the end of a stream whose request was aborted from outside
_LATER = object()  # a loop-thread call whose future the loop resolves later (a pause that drains)


def _put_all(puts: list) -> None:
    for q, item in puts:
        q.put_nowait(item)


async def stream_outputs(q: asyncio.Queue, on_leave) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to its final one; an exception put there is raised, _ABORTED (an
    abort from outside) just ends the stream. A consumer that leaves first (client disconnect) calls on_leave,
    which frees the request's blocks now. Closed with contextlib.aclosing, so that happens when it leaves."""
    finished = False
    try:
        while True:
            item = await q.get()
            if item is _ABORTED:
                finished = True
                return
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            on_leave()


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; the server reports unhealthy."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.engine.emit_partial = True
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.max_num_seqs = self.engine.config.max_num_seqs
        self.eos_token_ids = sorted(self.engine.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # accepted but not yet seen by the loop (counts as waiting); each counter has one writer thread
        self._adds_sent = 0
        self._adds_seen = 0
        self._wake = threading.Event()
        # RL: while paused or asleep the loop steps nothing and holds new requests until resume / wake;
        # a pause("wait") steps on, holding new requests, until what is in flight has finished
        self._paused = False
        self._asleep = False
        self._drains: list[concurrent.futures.Future] = []
        self._held: list[tuple] = []
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="pagefleet-engine", daemon=True)
        self._thread.start()

    # ---- the loop thread

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if self._drains and not engine.has_unfinished_requests():
                    self._pause_drained()
                if self._paused or self._asleep or not engine.has_unfinished_requests():
                    self._publish()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._deliver_step(engine.step())
                self._publish()
        except BaseException as e:  # a dead loop must not leave clients hanging
            self._error = e
            log.error("engine loop stopped: %s\n%s", e, traceback.format_exc())
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"engine loop stopped: {e}"), True)

    def _publish(self) -> None:
        """After each step and before each idle wait: the stats the probes read (an engine process also
        sends its step's outputs and these probes to the server here)."""
        self._stats = self.engine.stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, request_id, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                if self._paused or self._asleep or self._drains:  # added on resume / wake, in arrival order
                    self._held.append((request_id, *rest))
                    continue
                self._add(request_id, *rest)
            elif op == "call":  # request_id is unused here; rest = (function of the loop thread, future)
                fn, done = rest
                try:
                    result = fn()
                except Exception as e:  # the caller's to report; the engine keeps serving
                    done.set_exception(e)
                else:
                    if result is not _LATER:
                        done.set_result(result)
            else:
                self.engine.abort_request(request_id)

    def _add(self, request_id: str, *rest) -> None:
        self._adds_seen += 1
        if request_id not in self._streams:  # aborted before the loop saw it
            return
        try:
            self.engine.add_request(request_id, *rest)
        except ValueError as e:
            self._deliver(request_id, e, True)

    def _release_held(self) -> None:
        if not (self._paused or self._asleep or self._drains):
            held, self._held = self._held, []
            for request_id, *rest in held:
                self._add(request_id, *rest)

    def _ending(self, fn):
        """Run fn on the loop thread; the requests it ends (aborts) get their final output, finish reason
        "abort", so no client is left waiting."""
        before = dict(self.engine.requests)
        try:
            return fn()
        finally:
            self._deliver_step([self.engine.make_output(r, True) for request_id, r in before.items()
                                if request_id not in self.engine.requests])

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)

    def _pause_drained(self) -> None:
        drains, self._drains = self._drains, []
        self._paused = True
        for done in drains:
            done.set_result(None)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        self._deliver_all([(out.request_id, out, out.finished) for out in outputs])

    def _deliver(self, request_id: str, item, final: bool) -> None:
        self._deliver_all([(request_id, item, final)])

    def _deliver_all(self, items: list[tuple[str, object, bool]]) -> None:
        """(request id, item, final) to each stream, with one wake-up per event loop: call_soon_threadsafe
        writes to the loop's self-pipe on every call, so one call per stream makes 64 such writes a step at
        64 streams (and as many GIL hand-offs). A final item closes its stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item, final in items:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
            if stream is not None:
                loop, q = stream
                by_loop.setdefault(loop, []).append((q, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    # ---- the asyncio side

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; ValueError for a bad request comes before anything is yielded."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop stopped: {self._error}")
        self.engine.check_request(prompt_token_ids, params, lora_name)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._adds_sent += 1
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, lora_name))
        self._wake.set()
        async with contextlib.aclosing(stream_outputs(q, lambda: self.abort(request_id))) as items:
            async for item in items:
                yield item

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:  # wake a consumer still waiting on this request
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, _ABORTED)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- LoRA adapters: loaded and unloaded by the loop thread, between two steps

    async def load_lora(self, name: str, path: str) -> None:
        await self.call(lambda: self.engine.load_lora(name, path))

    async def load_lora_from_tensors(self, name: str, tensors, config: dict) -> None:
        """tensors: a dict, pairs, or the string of serialize_named_tensors (opened on the loop thread)."""
        await self.call(lambda: self.engine.load_lora_from_tensors(name, tensors, config))

    async def unload_lora(self, name: str) -> None:
        await self.call(lambda: self.engine.unload_lora(name))

    def lora_names(self) -> list[str]:
        return self.engine.lora_names()

    # ---- RL: weight updates, pause and resume, sleep and wake, run by the loop thread between two steps

    async def call(self, fn):
        """fn() on the loop thread, between two steps; its exception is raised here."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop stopped: {self._error}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", None, fn, done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def _update(self, fn, abort_all_requests: bool):
        def run():
            if abort_all_requests:
                self._ending(self._abort_all)
            return fn()
        return self.call(run)

    async def update_weights_from_disk(self, path: str, abort_all_requests: bool = False) -> int:
        return await self._update(lambda: self.engine.update_weights_from_disk(path), abort_all_requests)

    async def update_weights_from_tensor(self, named_tensors, abort_all_requests: bool = False) -> int:
        """named_tensors: (name, tensor) pairs, a dict, or the string of serialize_named_tensors (CUDA IPC
        handles are opened on the loop thread)."""
        def run():
            tensors = named_tensors
            if isinstance(tensors, str):
                from pagefleet.worker.executor.weight_transfer import deserialize_named_tensors

                tensors = deserialize_named_tensors(tensors)
            return self.engine.update_weights_from_tensor(tensors)
        return await self._update(run, abort_all_requests)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str | None = None) -> None:
        await self.call(lambda: self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                                      world_size, group_name, backend))

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str | None = None,
                                              abort_all_requests: bool = False) -> int:
        return await self._update(lambda: self.engine.update_weights_from_distributed(names, dtypes, shapes,
                                                                                       group_name),
                                  abort_all_requests)

    async def pause(self, mode: str = "abort") -> None:
        """abort: in-flight requests end now (finish reason "abort"); wait: returns once they have finished;
        keep: they stay, unstepped, and continue on resume. New requests, and those queued with nothing computed,
        wait for resume in every mode."""
        def run():
            if self._paused or self._drains:
                raise ValueError("the engine is paused already; resume it first")
            if mode == "wait":  # the engine holds what has not started; this loop steps the rest to their end
                self._ending(lambda: self.engine.pause(mode, drain=False))
                self._drains.append(done)
                return _LATER  # resolved by the loop once nothing is in flight
            self._ending(lambda: self.engine.pause(mode))
            self._paused = True
            return None

        if self._error is not None:
            raise EngineDeadError(f"engine loop stopped: {self._error}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", None, run, done))
        self._wake.set()
        await asyncio.wrap_future(done)

    async def resume(self) -> None:
        def run():
            if not self._paused:
                raise ValueError("the engine is not paused")
            self.engine.resume()
            self._paused = False
            self._release_held()
        await self.call(run)

    async def sleep(self, level: int = 1) -> None:
        def run():
            self.engine.sleep(level)
            self._asleep = True
        await self.call(run)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        def run():
            self.engine.wake_up(tags)
            self._asleep = self.engine.is_sleeping  # one tag wakes one part
            self._release_held()
        await self.call(run)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    # ---- probes

    def load(self) -> dict:
        s = self._stats
        return {
            "waiting": s.num_waiting + max(self._adds_sent - self._adds_seen, 0),
            "running": s.num_running,
            "kv_cache_usage": round(s.kv_cache_usage, 4),
            "max_num_seqs": self.max_num_seqs,
            # name -> folder: the gateway routes an adapter's requests to the workers holding it, and the
            # operator loads and unloads adapters to match spec.lora (a copy: the loop thread may change it)
            "lora_adapters": self.engine.lora_paths(),
            "weight_version": self.engine.weight_version,  # which policy a trainer's next samples come from
        }

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (drain on shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._streams and not self.engine.has_unfinished_requests():
                return True
            time.sleep(0.05)
        return False
