import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2_path():
    from pagefleet.worker.models.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from engine_models import TINY_ARCHS, tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: tiny_model(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture
def folded_rows(monkeypatch):
    """The row count of every forward that took LlamaForCausalLM's folded-norm path (decode graphs of a few
    rows, and their captures), in call order."""
    from pagefleet.worker.models.llama import LlamaForCausalLM

    rows = []
    real_forward_folded = LlamaForCausalLM.forward_folded

    def forward_folded(self, input_ids, positions):
        rows.append(input_ids.shape[0])
        return real_forward_folded(self, input_ids, positions)

    monkeypatch.setattr(LlamaForCausalLM, "forward_folded", forward_folded)
    return rows


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """On a GPU every engine takes its gpu_memory_fraction of the card, and engines hold reference cycles:
    collect them after each test, or the next test's engine finds the card already spoken for."""
    yield
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        import gc

        gc.collect()
        sys.modules["torch"].cuda.empty_cache()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that read an interpreter child (tests/interpreter.py) run last, so their children, started when
    collection ends, have the whole run's idle CPU before anyone waits for them."""
    items.sort(key=lambda item: item.get_closest_marker("interpreter") is not None)  # stable: order kept otherwise


def pytest_collection_finish(session):
    import interpreter

    if not interpreter.available():
        return
    for item in session.items:
        marker = item.get_closest_marker("interpreter")
        if marker is not None:
            interpreter.start(marker.args[0])


def pytest_sessionfinish(session):
    import interpreter

    interpreter.stop_all()


def pytest_terminal_summary(terminalreporter):
    """Skipped tests by reason, at the very end: a test that skips on a fresh machine (a missing tool, no GPU)
    shows here instead of passing unnoticed."""
    by_reason: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):
            path, _, reason = report.longrepr
        else:
            path, reason = report.nodeid.split("::")[0], str(report.longrepr)
        by_reason.setdefault(reason.removeprefix("Skipped: "), []).append(path)
    if not by_reason:
        return
    terminalreporter.write_sep("=", "skipped tests by reason")
    for reason, paths in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        files = sorted({_relative(Path(p), terminalreporter.config.rootpath) for p in paths})
        where = ", ".join(files[:3]) + (f" and {len(files) - 3} more files" if len(files) > 3 else "")
        terminalreporter.write_line(f"{len(paths):5d}  {reason}  ({where})")


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:  # outside the repository
        return path.as_posix()
