"""Tensor parallelism over the GPUs of one host: rank 0 is the engine's own runner, ranks 1..N-1 are worker
processes, each holding its shard of the model, its KV heads and its state slots.

The scheduler, the block manager and the sampler live on rank 0 only (vLLM's split). Each step rank 0 sends
the step's StepWork (block copies, state-slot work, host arrays; no Sequence) to every worker over a pipe and
runs it itself; the forwards meet in the layers' all-reduces and the logits' gather (models/layers/parallel.py),
over a process group of their own (NCCL on GPUs, gloo on CPU), outside torch.distributed's default group, so a
trainer's group in the same process is left alone. Sampled tokens an overlapped step reads on the device are
broadcast from rank 0 just before the step that reads them.

A rank that dies ends the engine: the collective the others wait in fails (gloo's connections close), or, where
it would wait for its timeout (NCCL), the monitor thread ends the process after FAIL_S with the rank's exit
status; a worker whose rank 0 is gone exits (its pipe closes, and on Linux the kernel signals it).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.executor.model_runner import ModelRunner
from pagefleet.worker.models.layers import parallel
from pagefleet.worker.models.loader import checkpoint_shapes, checkpoint_tensors
from pagefleet.worker.models.registry import ModelConfig

GROUP_TIMEOUT_S = 600.0  # a collective waits at most this long (a long prefill chunk must fit)
FAIL_S = 10.0  # after a rank dies, how long the engine's thread gets to fail on its own before the process ends


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot run another step."""


# A worker is a fresh interpreter (not multiprocessing's spawn, which re-runs the parent's __main__: a user's script
# without a main guard would start engines recursively), its cwd dropped from sys.path as `python -m` would not.
_WORKER_CODE = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
                "from pagefleet.worker.executor.tensor_parallel import main; main()")


def send(conn: Connection, message) -> None:
    """Plain pickle, tensors by value: Connection.send's pickler would pass a CPU tensor as a file descriptor
    shared through multiprocessing's resource sharer, which a worker started as a plain process cannot reach."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, size: int, port: int, device: torch.device,
               model_config: ModelConfig) -> parallel.TensorParallel:
    """This process's rank of the tensor-parallel group, for the model's layers."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.PrefixStore("pagefleet-tp", dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                                                           timeout=timeout))
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return parallel.TensorParallel(rank, size, group, model_config, device)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r on GPU r of the host (or of CUDA_VISIBLE_DEVICES), or the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if torch.cuda.device_count() < config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; this host shows "
                         f"{torch.cuda.device_count()}")
    return torch.device("cuda", rank)


def _rank_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    from dataclasses import replace

    threads = config.cpu_threads
    if device.type == "cpu" and threads is None:  # the ranks share the host's cores
        threads = max(1, (os.cpu_count() or 2) // 2 // config.tensor_parallel_size)
    return replace(config, device=str(device), cpu_threads=threads, compile_workers=0)


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the one that started it exits (a worker rank's rank 0, the
    engine process's server), wherever this one is blocked."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def main() -> None:
    """A worker process: its end of the socket pair in argv, its rank and the engine's settings from rank 0."""
    conn = Connection(int(sys.argv[1]))
    worker_main(conn, *recv(conn))


def worker_main(conn, rank: int, config: EngineConfig, model_config: ModelConfig, model_path, max_model_len: int,
                port: int) -> None:
    """A worker rank: bring up its shard, then run what rank 0 sends until told to stop (or rank 0 is gone)."""
    die_with_parent()
    try:
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel.set_tensor_parallel(join_group(rank, config.tensor_parallel_size, port, device, model_config))
        runner = ModelRunner(_rank_config(config, device), model_config, model_path, max_model_len)
        send(conn, ("ready", None))
        while True:
            try:
                message = recv(conn)
            except (EOFError, OSError):
                return  # rank 0 is gone
            kind = message[0]
            if kind == "stop":
                return
            if kind == "step":
                _, work, fed, adapters = message
                feed = None
                if fed is not None:
                    rows, shape, dtype = fed
                    feed = (rows, torch.empty(shape, dtype=dtype, device=runner.device))
                _run_step(runner, work, feed, adapters)
            elif kind == "lora":
                _, method, args = message
                getattr(runner.lora, method)(*args)
            elif kind == "weights_from_disk":
                runner.update_weights_from_disk(message[1])
            elif kind == "weights":
                runner.apply_weights(_received_weights(conn, runner.device), None)
            else:
                raise ValueError(f"unknown message {kind!r}")
    except BaseException:  # noqa: BLE001 - said to rank 0, which raises it as RankFailure
        try:
            send(conn, ("error", f"tensor-parallel rank {rank}:\n{traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _run_step(runner: ModelRunner, work, feed, adapters) -> torch.Tensor | None:
    """One step on any rank: the fed tokens from rank 0, the adapters' token rows, the forward."""
    if feed is not None:
        parallel.broadcast(feed[1])  # rank 0's sampled tokens into every other rank's buffer
    mapping = runner.lora.mapping_of(adapters) if adapters is not None else None
    return runner.execute(work, feed, mapping)


def _received_weights(conn, device: torch.device):
    """The (name, tensor) pairs rank 0 streams: each announced on the pipe, its data by broadcast."""
    while True:
        message = recv(conn)
        if message[0] == "end":
            return
        _, name, shape, dtype = message
        yield name, parallel.broadcast(torch.empty(shape, dtype=dtype, device=device))


class TensorParallelRunner:
    """Rank 0: a ModelRunner (its attributes read through, as the engine reads a runner's) that hands every step
    and every weight update to the worker ranks too."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path, max_model_len: int):
        size = config.tensor_parallel_size
        parallel.check_tensor_parallel(model_config, size)  # a readable refusal before any process starts
        device = rank_device(config, 0)
        port = _free_port()
        model_path = Path(model_path).resolve() if model_path is not None else None
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self._in_step = self._stopping = False
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            send(conn, (rank, config, model_config, model_path, max_model_len, port))
            self.conns.append(conn)
            self.procs.append(proc)
        self._monitor = threading.Thread(target=self._watch, name="pagefleet-tp-monitor", daemon=True)
        self._monitor.start()
        self._in_step = True  # bring-up meets the workers in collectives too
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.tp = join_group(0, size, port, device, model_config)
            with parallel.using(self.tp):
                self.runner = ModelRunner(_rank_config(config, device), model_config, model_path, max_model_len)
            for conn in self.conns:
                kind, detail = recv(conn)
                if kind != "ready":
                    raise RankFailure(detail)
        except ValueError:  # a setting the model cannot take (every rank found it): said as it is
            self.shutdown()
            raise
        except Exception as e:
            self.shutdown()
            raise self._failed(e) from None
        finally:
            self._in_step = False
        self.config = self.runner.config

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet: bring-up failed
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ---- what every rank runs

    @property
    def lora(self):
        """The adapters, loaded on every rank (None without --enable-lora)."""
        return None if self.runner.lora is None else ShardedLoRA(self)

    def run(self, batch, feed=None):
        work = self.runner.step_work(batch)
        lora = self.runner.lora
        adapters = lora.slot_rows(batch.seqs, batch.num_new_tokens) if lora is not None else None
        fed = None
        if feed is not None:
            rows, tokens = feed
            tokens = tokens.contiguous()
            feed, fed = (rows, tokens), (rows, tuple(tokens.shape), tokens.dtype)
        return self._all("step", work, fed, adapters, local=lambda: _run_step(self.runner, work, feed, adapters))

    def check_weights(self, shapes) -> dict:
        """An update checked on rank 0, against its shards, before any rank writes."""
        with parallel.using(self.tp):
            return self.runner.check_weights(shapes)

    def update_weights_from_disk(self, folder) -> None:
        plan = self.check_weights(checkpoint_shapes(folder))  # refused here, before any worker reads a file
        self._all("weights_from_disk", folder,
                  local=lambda: self.runner.apply_weights(checkpoint_tensors(folder, self.runner.device), plan))

    def apply_weights(self, named_tensors, plan: dict) -> None:
        """Rank 0's full tensors, each broadcast to the workers as it comes (a trainer's stream stays a stream)."""

        def streamed():
            try:
                for name, tensor in named_tensors:
                    tensor = tensor.to(self.runner.device).contiguous()
                    for conn in self.conns:
                        send(conn, ("tensor", name, tuple(tensor.shape), tensor.dtype))
                    yield name, parallel.broadcast(tensor)
            finally:  # the workers' streams end with rank 0's, however it ends
                for conn in self.conns:
                    send(conn, ("end",))

        self._all("weights", local=lambda: self.runner.apply_weights(streamed(), plan))

    def _all(self, kind: str, *args, local):
        """Send one message to every worker, then run rank 0's part: a failure anywhere is a RankFailure."""
        self._check()
        self._in_step = True
        try:
            for conn in self.conns:
                send(conn, (kind, *args))
            with parallel.using(self.tp):
                return local()
        except Exception as e:
            raise self._failed(e) from None
        finally:
            self._in_step = False

    def _lora(self, method: str, *args):
        """An adapter change on rank 0 first (its checks refuse a bad adapter before any worker sees it), then on
        every worker, which pick the same slot."""
        self._check()
        with parallel.using(self.tp):
            result = getattr(self.runner.lora, method)(*args)
        for conn in self.conns:
            send(conn, ("lora", method, args))
        return result

    # ---- failure and shutdown

    def _check(self) -> None:
        if self.failure is not None:
            raise RankFailure(f"tensor parallelism failed, the engine cannot continue: {self.failure}")

    def _failed(self, error: Exception) -> RankFailure:
        """The error to raise: a worker's own report when it sent one, else which rank exited and how."""
        if isinstance(error, RankFailure):
            return error
        reports = []
        for rank, conn in enumerate(self.conns, 1):
            try:
                while conn.poll(0.5 if self.procs[rank - 1].poll() is None else 0.1):
                    kind, detail = recv(conn)
                    if kind == "error":
                        reports.append(detail)
            except (EOFError, OSError):
                pass
        dead = [f"rank {rank} (pid {p.pid}) exited with {p.returncode}" for rank, p in enumerate(self.procs, 1)
                if p.poll() is not None]
        self.failure = "; ".join(reports or dead) or f"{type(error).__name__}: {error}"
        return RankFailure(f"tensor parallelism failed, the engine cannot continue: {self.failure}")

    def _watch(self) -> None:
        """Wait for the workers to exit; one that was not told to leaves the engine dead: say so, and end the
        process if the engine's thread stays blocked in a collective that will not return (NCCL)."""
        while not self._stopping:
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is None or self._stopping:
                    continue
                print(f"pagefleet: tensor-parallel rank {rank} (pid {proc.pid}) exited with {proc.returncode}; "
                      f"the engine cannot continue", file=sys.stderr, flush=True)
                self.failure = self.failure or f"rank {rank} (pid {proc.pid}) exited with {proc.returncode}"
                time.sleep(FAIL_S)
                if self._in_step and not self._stopping:
                    print(f"pagefleet: rank 0 still waits on rank {rank} after {FAIL_S:.0f} s: exiting",
                          file=sys.stderr, flush=True)
                    os._exit(70)
                return
            time.sleep(0.2)

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        self._stopping = True
        for conn in self.conns:
            try:
                send(conn, ("stop",))
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class ShardedLoRA:
    """Rank 0's LoRAManager as the engine reads it; loads and unloads reach every rank."""

    def __init__(self, runner: TensorParallelRunner):
        self._runner = runner

    def __getattr__(self, name: str):
        return getattr(self._runner.runner.lora, name)

    def load(self, name: str, path: str) -> int:
        return self._runner._lora("load", name, path)  # every rank reads the folder

    def load_tensors(self, name: str, tensors: dict, config: dict, path: str = "<tensors>") -> int:
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}  # pickled to the workers
        return self._runner._lora("load_tensors", name, tensors, config, path)

    def unload(self, name: str) -> None:
        self._runner._lora("unload", name)
