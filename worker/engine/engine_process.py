"""EngineProcess: the engine's step loop in a child process of its own, behind AsyncLLMEngine's interface.

In one process the HTTP event loop and the step thread share the GIL: at 64 streams the event loop's
per-chunk SSE sends keep the step thread waiting for it and the GPU idles. Here the child (a fresh
interpreter) runs AsyncLLMEngine, the same loop with its pause, drain, sleep and held-request rules, and
sends ONE message per step over a socket pair: per request the new tokens, text and logprobs (deltas;
cumulative outputs would cost pickling time quadratic in the output length) and its prompt logprobs once, with
what the probes read (load, stats, weight version, adapters, pause and sleep state) piggybacked, so /load and
/metrics cost no round trip. On the server a reader thread takes each message off the socket (a blocking read,
the GIL released) and wakes each event loop once for it; that loop rebuilds its streams' cumulative RequestOutputs.
RPCs (weight updates, adapters, pause / resume, sleep / wake_up) travel as (call id, method, args) and come
back with their result or their exception, ValueError kept as such.

The child dies with the server (PR_SET_PDEATHSIG, and its end of the socket closing); a child that dies
ends every stream with EngineDeadError and turns is_alive() False.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.core.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagefleet.worker.core.sampling_params import SamplingParams
from pagefleet.worker.engine.async_engine import _ABORTED, AsyncLLMEngine, EngineDeadError, stream_outputs
from pagefleet.worker.engine.stats import EngineStats, StepRecord

log = logging.getLogger("pagefleet.engine")

# A fresh interpreter, not multiprocessing's spawn (which re-runs the parent's __main__), its cwd dropped from
# sys.path as `python -m` would (the repository root's operator/ shadows the standard library's).
_CHILD_CODE = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
               "from pagefleet.worker.engine.engine_process import child_main; child_main()")
# The RPCs the child answers: AsyncLLMEngine's coroutine methods of the same names.
RPC_METHODS = frozenset({
    "load_lora", "load_lora_from_tensors", "unload_lora", "update_weights_from_disk", "update_weights_from_tensor",
    "init_weights_update_group", "update_weights_from_distributed", "pause", "resume", "sleep", "wake_up",
})


def _send(conn: Connection, message) -> None:
    """Plain pickle, tensors by value (Connection.send's pickler would pass CPU tensors as descriptors that a
    process started without multiprocessing cannot open)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _wire_error(e: BaseException) -> tuple:
    return type(e).__name__, str(e), getattr(e, "param", None)


def _rebuild_error(name: str, message: str, param) -> Exception:
    """The child's exception as the server's handlers catch it: EngineDeadError, builtin types (ValueError ->
    400) by name, anything else a RuntimeError naming its type."""
    if name == "EngineDeadError":
        return EngineDeadError(message)
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            e = cls(message)
        except Exception:
            e = RuntimeError(f"{name}: {message}")
    else:
        e = RuntimeError(f"{name}: {message}")
    if param is not None:
        e.param = param  # type: ignore[attr-defined]
    return e


# ---- the child


class _Sent:
    """What the server has of one request: its samples' token, text and logprob counts (the next delta's start), and
    whether its prompt logprobs went (once: they never change after)."""

    __slots__ = ("first", "samples", "scored")

    def __init__(self):
        self.first = True
        self.samples: list[list] = []  # per sample: [token count, text, logprob count]
        self.scored = False

    def delta(self, out: RequestOutput) -> tuple:
        samples = []
        for i, o in enumerate(out.outputs):
            if i == len(self.samples):
                self.samples.append([0, "", 0])
            sent = self.samples[i]
            ids = o.token_ids
            keep = sent[0] if len(ids) >= sent[0] else 0
            text, prev = o.text, sent[1]
            if text.startswith(prev):
                piece, replace = text[len(prev):], False
            else:
                piece, replace = text, True
            lps, lp_keep = None, 0
            if o.logprobs is not None:
                lp_keep = sent[2] if len(o.logprobs) >= sent[2] else 0
                lps = [(t.token_id, t.logprob, t.top) for t in o.logprobs[lp_keep:]]
                sent[2] = len(o.logprobs)
            sent[0], sent[1] = len(ids), text
            samples.append((o.index, keep, ids[keep:], replace, piece, lp_keep, lps, o.finish_reason,
                            o.stop_reason, o.weight_versions))
        prompt = out.prompt_token_ids if self.first else None
        self.first = False
        scored = None
        if not self.scored and out.prompt_logprobs is not None:
            self.scored = True
            scored = [None if e is None else (e.token_id, e.logprob, e.top, e.rank) for e in out.prompt_logprobs]
        return (out.request_id, prompt, out.finished, out.num_cached_tokens, out.weight_version,
                out.weight_versions, samples, scored)


class _ChildEngine(AsyncLLMEngine):
    """AsyncLLMEngine whose deliveries go over the connection: deltas are buffered as the loop makes them and
    sent, with the probes, once per step, per idle wait, and with each RPC's answer (after the outputs the
    call made, as the in-process engine orders them)."""

    def __init__(self, config: EngineConfig, conn: Connection):
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: list = []
        self._live = False  # nothing is sent before the ready message
        self._steps_sent = 0
        super().__init__(config)

    # ---- the loop thread (and the reader, for requests refused on arrival)

    def _loop(self) -> None:
        super()._loop()
        self._flush()  # a loop that stopped on an error: its streams' EngineDeadError, and alive False

    def _publish(self) -> None:
        super()._publish()
        self._flush()

    def _deliver_all(self, items: list[tuple[str, object, bool]]) -> None:
        wire = []
        for request_id, item, final in items:
            sent = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
            if sent is None:
                continue
            if isinstance(item, BaseException):
                wire.append((request_id, _wire_error(item)))
            else:
                wire.append(sent.delta(item))
        if wire:
            with self._send_lock:
                self._outbox.extend(wire)

    def _probes(self) -> dict:
        s = self._stats
        new = s.steps_total - self._steps_sent
        steps = [dataclasses.astuple(r) for r in s.recent_steps[-new:]] if new > 0 else []
        self._steps_sent = s.steps_total
        return {
            "load": self.load(), "stats": dataclasses.replace(s, recent_steps=[]), "steps": steps,
            "lora_names": self.engine.lora_names(), "paused": self._paused, "sleeping": self._asleep,
            "alive": self._error is None, "adds": self._adds_sent,
            "unfinished": bool(self._streams) or self.engine.has_unfinished_requests(),
        }

    def _flush(self, reply: tuple | None = None) -> None:
        with self._send_lock:
            if not self._live:
                return
            outbox, self._outbox = self._outbox, []
            try:
                _send(self._conn, ("m", outbox, self._probes(), reply))
            except OSError:  # the server is gone; the reader ends this process
                pass

    # ---- the reader thread

    def start_sending(self, facts: dict) -> None:
        with self._send_lock:
            _send(self._conn, ("ready", facts, self._probes()))
            self._live = True

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora_name) -> None:
        self._streams[request_id] = _Sent()
        try:
            if self._error is not None:
                raise EngineDeadError(f"engine loop stopped: {self._error}")
            self.engine.check_request(prompt_token_ids, params, lora_name)
        except Exception as e:
            self._deliver(request_id, e, True)
            self._flush()
            return
        self._adds_sent += 1
        self._inbox.put(("add", request_id, prompt_token_ids, params, lora_name))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    async def rpc(self, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            if method not in RPC_METHODS:
                raise ValueError(f"the engine process has no call {method!r}")
            result = await getattr(self, method)(*args, **kwargs)
        except Exception as e:
            self._flush((call_id, False, _wire_error(e)))
        else:
            self._flush((call_id, True, result))


def _ignore_stop_signals() -> None:
    """SIGTERM and SIGINT sent to the whole process group (systemd, a terminal's Ctrl-C) are the server's to act
    on: it drains, then stops this process. No-op handlers, not SIG_IGN, so the tensor-parallel ranks this
    process starts get the default actions back at exec."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def child_main() -> None:
    """The engine process: its end of the socket pair in argv, the engine's config first on it."""
    from pagefleet.worker.executor.tensor_parallel import die_with_parent  # this side imports torch anyway

    die_with_parent()
    _ignore_stop_signals()
    conn = Connection(int(sys.argv[1]))
    config = _recv(conn)
    try:
        engine = _ChildEngine(config, conn)
    except BaseException as e:  # the server's constructor raises it with this message
        _send(conn, ("error", _wire_error(e), traceback.format_exc()))
        os._exit(1)
    core = engine.engine
    model_config = getattr(core, "model_config", None)
    facts = {
        "tokenizer": engine.tokenizer, "model_name": engine.model_name, "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs, "eos_token_ids": engine.eos_token_ids,
        "block_size": core.block_manager.block_size,
        "num_blocks": core.block_manager.num_blocks, "vocab_size": getattr(model_config, "vocab_size", None),
        "architecture": getattr(model_config, "architecture", None), "kv_cache_dtype": core.config.kv_cache_dtype,
        "steps_maxlen": core.recent_steps.maxlen,
    }
    loop = asyncio.new_event_loop()  # where the RPCs' coroutines (AsyncLLMEngine's own methods) run
    threading.Thread(target=loop.run_forever, name="pagefleet-engine-rpc", daemon=True).start()
    from pagefleet.worker.executor.startup.gc_freeze import freeze_startup_heap

    freeze_startup_heap()  # as `pagefleet serve` does in one process: full GC passes paused the loop
    engine.start_sending(facts)
    message, kind = None, None
    try:
        while True:
            try:
                message = _recv(conn)
            except (EOFError, OSError):  # the server is gone
                break
            kind = message[0]
            if kind == "add":
                engine.add(*message[1:])
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "call":
                asyncio.run_coroutine_threadsafe(engine.rpc(*message[1:]), loop)
            elif kind == "stop":
                break
    finally:
        try:
            engine.shutdown(message[1] if kind == "stop" else 5.0)
        except BaseException:
            log.error("engine shutdown failed:\n%s", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # leftover threads (the RPC loop, compile pools) must not keep the process


# ---- the server side


class _Stream:
    """One request's stream on the server: its event loop and queue, and the cumulative output it rebuilds."""

    __slots__ = ("loop", "queue", "prompt", "samples", "prompt_logprobs")

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: list[int]):
        self.loop, self.queue, self.prompt = loop, asyncio.Queue(), prompt
        self.samples: list[CompletionOutput] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    def apply(self, delta: tuple) -> RequestOutput:
        request_id, prompt, finished, cached, version, versions, samples, scored = delta
        if prompt is not None:
            self.prompt = prompt
        if scored is not None:
            self.prompt_logprobs = [None if e is None else TokenLogprobs(*e) for e in scored]
        outputs = []
        for i, (index, keep, ids, replace, piece, lp_keep, lps, finish, stop, weight_versions) in enumerate(samples):
            prev = self.samples[i] if i < len(self.samples) else None
            if prev is None:
                token_ids, text, logprobs = list(ids), piece, None
            else:  # fresh lists per output: a consumer may hold an earlier one
                token_ids = prev.token_ids[:keep] + ids
                text = piece if replace else prev.text + piece
                logprobs = prev.logprobs
            if lps is not None:
                new = [TokenLogprobs(t, lp, top) for t, lp, top in lps]
                logprobs = (logprobs or [])[:lp_keep] + new
            out = CompletionOutput(index, text, token_ids, finish, logprobs, stop, weight_versions)
            if prev is None:
                self.samples.append(out)
            else:
                self.samples[i] = out
            outputs.append(out)
        return RequestOutput(request_id, self.prompt, outputs, finished, cached, version, versions,
                             self.prompt_logprobs)


def _apply_all(puts: list) -> None:
    for stream, item in puts:
        if isinstance(item, tuple):
            item = stream.apply(item)
        stream.queue.put_nowait(item)


class EngineProcess:
    """AsyncLLMEngine's interface over an engine in a child process (see the module docstring). Build it on a
    thread that lives as long as the engine (the main thread): the kernel ends the child with the thread that
    started it (PR_SET_PDEATHSIG)."""

    def __init__(self, config: EngineConfig):
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._adds_sent = 0
        self._error: BaseException | None = None
        self._closing = False
        try:
            _send(self._conn, config)
            message = _recv(self._conn)
        except (EOFError, OSError):
            message = None
        if message is None or message[0] != "ready":
            self._proc.wait()
            self._conn.close()
            if message is None:
                raise RuntimeError(f"the engine process exited with status {self._proc.returncode} while starting")
            (name, text, param), tb = message[1], message[2]
            log.debug("engine process start-up failed:\n%s", tb)
            raise _rebuild_error(name, text, param)
        facts, probes = message[1], message[2]
        self.tokenizer = facts["tokenizer"]
        self.model_name = facts["model_name"]
        self.max_model_len = facts["max_model_len"]
        self.max_num_seqs = facts["max_num_seqs"]
        self.eos_token_ids = facts["eos_token_ids"]
        # what api_server otherwise reads from AsyncLLMEngine.engine, the LLMEngine
        self.block_size = facts["block_size"]
        self.num_blocks = facts["num_blocks"]
        self.vocab_size = facts["vocab_size"]
        self.architecture = facts["architecture"]
        self.kv_cache_dtype = facts["kv_cache_dtype"]
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=facts["steps_maxlen"])
        self._probes = probes
        self._take_steps(probes)
        self._reader = threading.Thread(target=self._read, name="pagefleet-engine-reader", daemon=True)
        self._reader.start()

    # ---- the reader thread

    def _take_steps(self, probes: dict) -> None:
        if probes["steps"]:
            self._steps.extend(StepRecord(*r) for r in probes["steps"])

    def _read(self) -> None:
        conn, streams = self._conn, self._streams
        try:
            while True:
                _, items, probes, reply = _recv(conn)
                self._take_steps(probes)
                self._probes = probes
                if items:
                    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                    for item in items:
                        request_id = item[0]
                        if len(item) == 2:  # (request id, error): the stream's end
                            stream, item = streams.pop(request_id, None), _rebuild_error(*item[1])
                        else:
                            stream = streams.pop(request_id, None) if item[2] else streams.get(request_id)
                        if stream is not None:
                            by_loop.setdefault(stream.loop, []).append((stream, item))
                    for loop, puts in by_loop.items():
                        loop.call_soon_threadsafe(_apply_all, puts)
                if reply is not None:
                    call_id, ok, value = reply
                    done = self._calls.pop(call_id, None)
                    if done is not None:
                        if ok:
                            done.set_result(value)
                        else:
                            done.set_exception(_rebuild_error(*value))
        except (EOFError, OSError):
            pass
        except BaseException:
            log.error("engine process reader stopped:\n%s", traceback.format_exc())
        self._died()

    def _died(self) -> None:
        """The child is gone (or unreadable): end every stream and call with EngineDeadError."""
        code = self._proc.poll()
        if code is None:
            try:
                code = self._proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
        what = "shut down" if self._closing else f"exited with status {code}"
        self._error = EngineDeadError(f"the engine process {what}")
        if not self._closing:
            log.error("engine process %s", what)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, EngineDeadError(str(self._error))))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_apply_all, puts)
            except RuntimeError:  # that loop is closed: nobody waits there
                pass
        for call_id in list(self._calls):
            done = self._calls.pop(call_id, None)
            if done is not None:
                done.set_exception(EngineDeadError(str(self._error)))

    def _post(self, message) -> None:
        try:
            with self._send_lock:
                _send(self._conn, message)
        except OSError as e:
            raise EngineDeadError(f"the engine process is gone: {e}") from None

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if not self._probes["alive"]:
            raise EngineDeadError("engine loop stopped")

    # ---- the asyncio side

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; ValueError for a bad request comes before anything is yielded."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        stream = _Stream(asyncio.get_running_loop(), prompt)
        self._streams[request_id] = stream
        if self._error is not None:  # died between the check and the registration: no one would end it
            self._streams.pop(request_id, None)
            raise EngineDeadError(str(self._error))
        self._adds_sent += 1
        try:
            self._post(("add", request_id, prompt, params, lora_name))
        except BaseException:
            self.abort(request_id)
            raise
        async with contextlib.aclosing(stream_outputs(stream.queue, lambda: self.abort(request_id))) as items:
            async for item in items:
                yield item

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:  # wake a consumer still waiting on this request
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _ABORTED)
        if self._error is None:
            try:
                self._post(("abort", request_id))
            except EngineDeadError:
                pass

    async def _call(self, method: str, *args, **kwargs):
        self._check_alive()
        call_id = next(self._call_ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = done
        if self._error is not None:
            self._calls.pop(call_id, None)
            raise EngineDeadError(str(self._error))
        try:
            self._post(("call", call_id, method, args, kwargs))
        except EngineDeadError:
            self._calls.pop(call_id, None)
            raise
        return await asyncio.wrap_future(done)

    async def load_lora(self, name: str, path: str) -> None:
        await self._call("load_lora", name, path)

    async def load_lora_from_tensors(self, name: str, tensors, config: dict) -> None:
        """tensors: the string of serialize_named_tensors (opened in the engine process), or a dict / pairs of
        CPU tensors (sent by value)."""
        await self._call("load_lora_from_tensors", name, tensors, config)

    async def unload_lora(self, name: str) -> None:
        await self._call("unload_lora", name)

    def lora_names(self) -> list[str]:
        return list(self._probes["lora_names"])

    async def update_weights_from_disk(self, path: str, abort_all_requests: bool = False) -> int:
        return await self._call("update_weights_from_disk", path, abort_all_requests)

    async def update_weights_from_tensor(self, named_tensors, abort_all_requests: bool = False) -> int:
        """named_tensors: the string of serialize_named_tensors (CUDA IPC handles are opened in the engine
        process), or CPU tensors as pairs or a dict (sent by value)."""
        return await self._call("update_weights_from_tensor", named_tensors, abort_all_requests)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str | None = None) -> None:
        await self._call("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                         group_name, backend)

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str | None = None,
                                              abort_all_requests: bool = False) -> int:
        return await self._call("update_weights_from_distributed", names, dtypes, shapes, group_name,
                                abort_all_requests)

    async def pause(self, mode: str = "abort") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    @property
    def weight_version(self) -> int:
        return self._probes["load"]["weight_version"]

    @property
    def is_paused(self) -> bool:
        return self._probes["paused"]

    @property
    def is_sleeping(self) -> bool:
        return self._probes["sleeping"]

    # ---- probes: what the child's last message said, no round trip

    def load(self) -> dict:
        load = dict(self._probes["load"])
        # accepted here but not yet read by the engine process
        load["waiting"] += max(self._adds_sent - self._probes["adds"], 0)
        return load

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._probes["stats"], recent_steps=list(self._steps))

    def is_alive(self) -> bool:
        return self._error is None and self._probes["alive"] and self._proc.poll() is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process: its loop and its tensor-parallel ranks, then the process (killed after
        timeout plus a grace period)."""
        self._closing = True
        if self._proc.poll() is None:
            try:
                self._post(("stop", timeout))
            except EngineDeadError:
                pass
            try:
                self._proc.wait(timeout + 5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout)
        self._conn.close()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (drain on shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._streams and not self._probes["unfinished"]:
                return True
            time.sleep(0.05)
        return False
