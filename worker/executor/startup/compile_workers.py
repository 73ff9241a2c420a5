"""Start-up kernel compiles in parallel: worker processes fill Triton's on-disk cache while this one loads.

A cold start spent ~30 s of its ~53 s compiling kernel variants one after another, each on its first
launch (the eager warm-up, then the decode graphs; H200, 8B shape, FP8). Each worker builds a two-layer
twin of the model (same shapes, random weights: the variants depend on shapes and settings, not on values
or on depth past the second layer) and runs its share of the warm-up steps and graph captures. They start
before this process imports torch; meanwhile it imports, reads the tokenizer and loads the weights, and its
own warm-up then finds the variants on disk. The workers exit before this process sizes its KV cache from
free memory.

A marker in the cache folder records a start-up that finished with these kernel and engine sources and
settings, so a warm cache (a restart on the same node: the operator's kernel-cache volume) starts no workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import IO

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.models.registry import ModelConfig

WAIT_SECONDS = 300  # a worker still compiling after this is stopped; this process compiles what is left
# H200 machine, 16 cores, FP8 8B cold start: 3 / 4 / 6 workers were done 23.0 / 25.0 / 18.9 s after they
# started; 8 took 25.2 s (they contend for the cores and the GPU while this process loads the weights)
MAX_AUTO_WORKERS = 6


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" without a limit


def usable_cpus() -> int:
    """CPUs this process may use: its CPU set, capped by its cgroup's CPU quota (a container's CPU limit, which
    leaves the CPU set at the whole node)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 here
        pass
    return cpus


def auto_workers() -> int:
    """Half the CPUs this process may use, at most MAX_AUTO_WORKERS."""
    return max(1, min(MAX_AUTO_WORKERS, usable_cpus() // 2))


def cache_dir() -> Path:
    """Triton's kernel cache folder (TRITON_CACHE_DIR, else its default)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def warm_marker(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> Path:
    """The marker file of a finished start-up with these sources, versions, GPUs, shapes and settings.
    Told without importing torch or Triton: the workers start before this process imports them.
    The worker's sources count as well as the kernels': which variants a start-up launches is decided
    there too (warm-up steps, graph sizes, the model's calls)."""
    h = hashlib.sha256()
    for folder in source_folders():
        for f in sorted(folder.rglob("*.py")):
            h.update(f.read_bytes())
    shape = dataclasses.asdict(model_config) | {"num_hidden_layers": 0, "eos_token_ids": []}
    settings = {k: getattr(config, k) for k in ("dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                                 "enforce_eager", "quantization", "kv_cache_dtype", "enable_lora",
                                                 "max_loras", "max_lora_rank")}
    h.update(json.dumps([shape, settings, max_model_len, _version("torch"), _version("triton"), _gpu_models()],
                        sort_keys=True, default=str).encode())
    return cache_dir() / "pagefleet" / f"warm-{h.hexdigest()[:24]}"


def source_folders() -> list[Path]:
    return [Path(importlib.util.find_spec(p).submodule_search_locations[0])
            for p in ("pagefleet.kernels", "pagefleet.worker")]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _gpu_models() -> list[str]:
    """The NVIDIA driver's model line of each GPU on this machine (a Triton cache may be a node's hostPath)."""
    return sorted(f.read_text().split("\n", 1)[0] for f in Path("/proc/driver/nvidia/gpus").glob("*/information"))


NVIDIA_DRIVER_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/gpus")  # any one: a driver and a GPU


def nvidia_gpu_visible(device: str) -> bool:
    """Whether the engine is about to run on an NVIDIA GPU, told without importing torch (seconds of import
    the workers would otherwise wait for): asked for CUDA by name, or else the driver's files are there, and
    CUDA_VISIBLE_DEVICES does not hide every GPU. A worker that finds no CUDA after all exits at once."""
    if device == "cpu" or os.environ.get("CUDA_VISIBLE_DEVICES", "all").strip() in ("", "-1"):
        return False
    return device.startswith("cuda") or any(os.path.exists(f) for f in NVIDIA_DRIVER_FILES)


class CompileWorkers:
    """The worker processes of one start-up; wait() before sizing the KV cache."""

    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig, max_model_len: int):
        self.procs: list[tuple[subprocess.Popen, IO[bytes]]] = []  # each worker and its stderr
        self.marker = warm_marker(config, model_config, max_model_len)
        self.cached_after_workers: set[str] | None = None  # the cache's entries when the workers were done
        if self.marker.exists():
            return
        n = auto_workers() if config.compile_workers is None else config.compile_workers
        for i in range(n):
            log = tempfile.TemporaryFile()
            cmd = worker_command(config, model_path, max_model_len, (i, n))
            # run from the temp folder: `-m` puts the working folder on sys.path, and a checkout's top-level
            # operator/ would shadow the standard library's
            try:
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=tempfile.gettempdir())
                self.procs.append((proc, log))
            except OSError as e:  # no process to spare: this process compiles what the others do not
                print(f"pagefleet: could not start a compile worker ({e})", flush=True)
                log.close()
                break
        self.started = time.perf_counter()
        # if start-up fails before wait() (a bad tokenizer, an interrupt), the workers go with this process
        weakref.finalize(self, _kill, [p for p, _ in self.procs])

    def wait(self) -> None:
        if not self.procs:
            return
        failed, phases = [], []
        for proc, log in self.procs:
            try:
                proc.wait(timeout=max(1.0, WAIT_SECONDS - (time.perf_counter() - self.started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            lines = log.read().decode(errors="replace").strip().splitlines() or ["no output"]
            if proc.returncode:
                failed.append(f"exit {proc.returncode}: {lines[-1]}")  # the exception's own line
            elif lines[-1].startswith("phases: "):
                phases.append(lines[-1][len("phases: "):])
            log.close()
        self.cached_after_workers = _cache_entries()
        n = len(self.procs)
        print(f"pagefleet: {n} compile worker{'s' if n != 1 else ''} done in {time.perf_counter() - self.started:.1f}s "
              f"({len(self.cached_after_workers)} kernels cached)", flush=True)
        if phases:  # the last one to finish: what the start-up waited for
            print(f"pagefleet: slowest compile worker: {max(phases, key=_all_seconds)}", flush=True)
        for f in failed:  # not fatal: this process compiles whatever they did not
            print(f"pagefleet: a compile worker failed ({f})", flush=True)
        self.procs = []

    def mark_warm(self) -> None:
        """After this process's own warm-up and graph capture: the cache now holds every variant."""
        if self.cached_after_workers is not None:
            new = sorted(_kernel_name(cache_dir() / e) for e in _cache_entries() - self.cached_after_workers)
            print(f"pagefleet: this process compiled {len(new)} kernels the workers had not"
                  f"{': ' + ', '.join(new) if new else ''}", flush=True)
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
        except OSError as e:  # a read-only cache (filled elsewhere) serves as well; the next start tries again
            print(f"pagefleet: could not mark the kernel cache warm ({e})", flush=True)


def share_of(items: list, share: tuple[int, int] | None) -> list:
    """A compile worker's slice: share (i, n) takes every n-th item from the i-th; None takes them all."""
    return items if share is None else items[share[0]:: share[1]]


def worker_command(config: EngineConfig, model_path: Path, max_model_len: int, share: tuple[int, int]) -> list[str]:
    """The command line of worker share[0] of share[1]: the engine's settings as JSON, read back by _work."""
    spec = {"config": dataclasses.asdict(config), "model": str(Path(model_path).resolve()),
            "max_model_len": max_model_len, "share": list(share)}
    return [sys.executable, "-m", "pagefleet.worker.executor.startup.compile_workers", json.dumps(spec)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()  # a no-op for one already waited for


def _all_seconds(phases: str) -> float:
    return float(phases.rsplit(" ", 1)[-1].rstrip("s"))


def _cache_entries() -> set[str]:
    """Triton's cache folder holds one subfolder per compiled kernel (or launcher)."""
    folder = cache_dir()
    return {e.name for e in folder.iterdir() if e.is_dir() and e.name != "pagefleet"} if folder.exists() else set()


def _kernel_name(entry: Path) -> str:
    names = sorted(f.stem for f in entry.iterdir() if f.suffix in (".cubin", ".so"))
    return names[0] if names else entry.name


def start(config: EngineConfig, model_path: Path, model_config: ModelConfig,
          max_model_len: int) -> CompileWorkers | None:
    """Compile workers for this start-up; None without an NVIDIA GPU or with compile_workers=0."""
    if config.compile_workers == 0 or not nvidia_gpu_visible(config.device):
        return None
    return CompileWorkers(config, model_path, model_config, max_model_len)


def _work(spec: dict) -> None:
    """A worker: build the two-layer twin and run its share of the warm-up steps and graph captures. Its
    last line on stderr gives its phases' seconds, for the start-up's summary."""
    start = time.perf_counter()
    import torch

    from pagefleet.worker.executor.model_runner import ModelRunner
    from pagefleet.worker.models.loader import load_model_config

    imported = time.perf_counter()
    config = EngineConfig(**spec["config"])
    if config.device != "cpu" and not torch.cuda.is_available():  # the driver is there, CUDA is not: nothing to do
        print("phases: no CUDA here, all 0.0s", file=sys.stderr, flush=True)
        return

    # two layers: the second reads the norm sums a GEMV wrote, the first those of the embeddings (other variants)
    model_config = load_model_config(Path(spec["model"]))
    model_config = model_config.twin(2)
    max_model_len = spec["max_model_len"]
    blocks = -(-max_model_len // config.block_size) + 1  # one sequence at full length: the least the runner takes
    config = dataclasses.replace(config, compile_workers=0, num_gpu_blocks_override=blocks)
    runner = ModelRunner(config, model_config, None, max_model_len, compile_share=tuple(spec["share"]))
    t = runner.start_seconds
    print(f"phases: imports {imported - start:.1f}s, twin {t['load']:.1f}s, warm-up {t['warmup']:.1f}s, graphs "
          f"{t['graphs']:.1f}s, all {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _work(json.loads(sys.argv[1]))
