"""Compile workers (worker/executor/startup/compile_workers.py): the process mechanics on CPU, where a worker builds
its twin and has no kernels to compile. tests/executor/test_engine_gpu.py checks on CUDA that they compile what
start-up needs."""

import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.worker.core.config import EngineConfig
from pagefleet.worker.executor.startup import compile_workers as precompile
from pagefleet.worker.models.loader import load_model_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path / "triton"


def cpu_workers(model_path, workers: int, **settings):
    """CompileWorkers of the model at model_path on CPU (max_model_len 256)."""
    config = EngineConfig(model=str(model_path), device="cpu", compile_workers=workers, **settings)
    return precompile.CompileWorkers(config, model_path, load_model_config(model_path), 256)


def run_worker(config, model_path, cwd):
    """One worker as CompileWorkers starts it (share 0 of 1)."""
    cmd = precompile.worker_command(config, model_path, 128, (0, 1))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_no_workers_off_cuda_or_when_disabled(smollm2_path):
    mc = load_model_config(smollm2_path)
    assert precompile.start(EngineConfig(model=str(smollm2_path), device="cpu"), smollm2_path, mc, 256) is None
    assert precompile.start(EngineConfig(model=str(smollm2_path), compile_workers=0), smollm2_path, mc, 256) is None
    with pytest.raises(ValueError, match="compile_workers must be >= 0"):
        EngineConfig(compile_workers=-1).validate()


def test_a_negative_worker_count_is_refused_at_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pagefleet", "serve", "--compile-workers", "-1"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "compile_workers must be >= 0, got -1" in done.stdout + done.stderr


def test_an_nvidia_gpu_is_told_without_torch(monkeypatch):
    """The engine starts its workers before it imports torch: the GPU check and the marker must not import it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for present in precompile.NVIDIA_DRIVER_FILES:
        monkeypatch.setattr(precompile.os.path, "exists", lambda path, present=present: path == present)
        assert precompile.nvidia_gpu_visible("auto") and precompile.nvidia_gpu_visible("cuda:1")
        assert not precompile.nvidia_gpu_visible("cpu")
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not precompile.nvidia_gpu_visible("auto") and not precompile.nvidia_gpu_visible("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(precompile.os.path, "exists", lambda path: False)  # no NVIDIA driver
    assert not precompile.nvidia_gpu_visible("auto")
    assert precompile.nvidia_gpu_visible("cuda")  # asked for by name: a worker finds out, and exits if there is none


def test_the_engine_reaches_its_workers_before_torch(smollm2_path):
    code = ("import sys; from pathlib import Path; "
            "import pagefleet.worker.entrypoints.serve, pagefleet.worker.engine.async_engine; "
            "from pagefleet.worker.executor.startup import compile_workers as precompile; "
            "from pagefleet.worker.core.config import EngineConfig; "
            "from pagefleet.worker.models.loader import load_model_config, resolve_model_path; "
            f"path = resolve_model_path({str(smollm2_path)!r}); "
            "precompile.warm_marker(EngineConfig(), load_model_config(path), 256); "
            "precompile.start(EngineConfig(), path, load_model_config(path), 256); "
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(smollm2_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_worker_without_cuda_exits_at_once(smollm2_path, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: a worker would compile")
    done = run_worker(EngineConfig(model=str(smollm2_path)), smollm2_path, tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 0 and last == "phases: no CUDA here, all 0.0s", done.stderr[-2000:]


def test_the_default_count_follows_the_container_cpu_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    limit = tmp_path / "cpu.max"
    monkeypatch.setattr(precompile, "CGROUP_CPU_MAX", limit)
    limits = (("max 100000", 64, 6), ("200000 100000", 2, 1), ("450000 100000", 5, 2), ("50000 100000", 1, 1))
    for text, cpus, workers in limits:
        limit.write_text(text + "\n")
        assert (precompile.usable_cpus(), precompile.auto_workers()) == (cpus, workers), text
    limit.unlink()  # no cgroup v2: the CPU set alone
    assert precompile.usable_cpus() == 64


def test_a_worker_builds_its_twin_from_the_engine_settings(smollm2_path, tmp_path):
    """The command line a worker gets: every EngineConfig field through JSON, a two-layer random twin, its share."""
    config = EngineConfig(model=str(smollm2_path), device="cpu", max_num_seqs=8, enable_prefix_caching=False)
    done = run_worker(config, smollm2_path, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("phases: imports ")


def test_workers_run_once_then_the_marker_skips_them(smollm2_path, cache, capsys):
    workers = cpu_workers(smollm2_path, 2)
    assert len(workers.procs) == 2
    workers.wait()
    workers.mark_warm()
    out = capsys.readouterr().out
    assert "2 compile workers done" in out and "failed" not in out
    assert "this process compiled 0 kernels" in out
    assert workers.marker.exists() and workers.marker.parent.parent == cache
    assert cpu_workers(smollm2_path, 2).procs == []  # warm: none started
    # other settings are another marker: workers again
    other = cpu_workers(smollm2_path, 1, max_num_seqs=8)
    assert len(other.procs) == 1 and other.marker != workers.marker
    other.wait()


def test_the_marker_follows_the_worker_sources_too(smollm2_path, cache, tmp_path, monkeypatch):
    """A change to the engine's code (its warm-up steps, graph sizes, model calls) can need kernel variants
    the cache lacks, as much as a change to the kernels: either makes a new marker, and workers run again."""
    kernels, worker = tmp_path / "kernels", tmp_path / "worker" / "models"
    for folder in (kernels, worker):
        folder.mkdir(parents=True)
        (folder / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(precompile, "source_folders", lambda: [kernels, worker.parent])
    config, mc = EngineConfig(), load_model_config(smollm2_path)
    first = precompile.warm_marker(config, mc, 256)
    assert precompile.warm_marker(config, mc, 256) == first
    (worker / "a.py").write_text("x = 2\n")  # a module in a subfolder (worker/models)
    second = precompile.warm_marker(config, mc, 256)
    assert second != first
    (kernels / "a.py").write_text("x = 2\n")
    assert precompile.warm_marker(config, mc, 256) not in (first, second)


def test_a_cache_it_cannot_mark_is_not_fatal(smollm2_path, cache, capsys):
    """A cache folder the marker cannot go into (read-only, filled elsewhere): start-up goes on and says so.
    A file where the marker's folder should be fails for root too."""
    cache.mkdir()
    (cache / "pagefleet").write_text("not a folder")
    workers = cpu_workers(smollm2_path, 1)
    workers.wait()
    workers.mark_warm()
    assert "could not mark the kernel cache warm" in capsys.readouterr().out
    assert not workers.marker.exists()


def test_a_worker_that_cannot_start_is_not_fatal(smollm2_path, cache, capsys, monkeypatch):
    real_popen, started = precompile.subprocess.Popen, []

    def popen(*args, **kwargs):
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(1)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(precompile.subprocess, "Popen", popen)
    workers = cpu_workers(smollm2_path, 3)
    assert len(workers.procs) == 1
    workers.wait()
    out = capsys.readouterr().out
    assert "could not start a compile worker ([Errno 11] Resource temporarily unavailable)" in out
    assert "1 compile worker done" in out


def test_a_failed_worker_is_reported_not_fatal(smollm2_path, cache, capsys):
    mc = load_model_config(smollm2_path)
    config = EngineConfig(device="cpu", compile_workers=1)
    workers = precompile.CompileWorkers(config, Path("/nonexistent-model"), mc, 256)
    workers.wait()
    out = capsys.readouterr().out
    assert "a compile worker failed (exit 1: FileNotFoundError" in out and "nonexistent-model" in out
    assert not workers.marker.exists()
