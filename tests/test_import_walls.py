"""The walls between layers (the import rules of the design map), checked on the source.

Each wall is a static scan of every import statement (inside functions and TYPE_CHECKING blocks too, since
a lazy import is still a dependency), with relative imports resolved to their absolute name; the torch-free
core is also imported for real, module by module, in a fresh interpreter. A failure names the file, the
line and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders and the package each one is installed as ([tool.setuptools] package-dir).
PACKAGES = {"pagefleet": "pagefleet", "worker": "pagefleet.worker", "kernels": "pagefleet.kernels",
            "operator": "pagefleet.operator", "gateway": "pagefleet.gateway"}
HTTP = ("fastapi", "pydantic", "uvicorn", "starlette")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path) -> list[tuple[int, str, bool]]:
    """(line, absolute module name, relative?) of every import in a file; `from a import b` gives a and a.b."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((node.lineno, base, bool(node.level)))
            found += [(node.lineno, f"{base}.{alias.name}", bool(node.level)) for alias in node.names]
    return found


def files(root: Path, folder: str) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def breaches(root: Path, folders: list[str], forbidden: tuple[str, ...], exempt: tuple[str, ...] = (),
             allow=lambda name, relative: False) -> list[str]:
    """`file:line imports name` for each import under `folders` (minus `exempt`) of a `forbidden` module."""
    found = []
    for folder in folders:
        for path in files(root, folder):
            rel = path.relative_to(root).as_posix()
            if any(rel.startswith(e + "/") for e in exempt):
                continue
            for line, name, relative in imports(path, root):
                if any(under(name, f) for f in forbidden) and not allow(name, relative):
                    found.append(f"{rel}:{line} imports {name}")
    return sorted(set(found))


def core_imports_no_engine_side(root: Path) -> list[str]:
    return breaches(root, ["worker/core"], ("torch", "pagefleet.worker.engine", "pagefleet.worker.executor",
                                            "pagefleet.worker.models", "pagefleet.worker.entrypoints"))


def only_entrypoints_know_http(root: Path) -> list[str]:
    return breaches(root, ["worker", "kernels", "pagefleet"], HTTP, exempt=("worker/entrypoints",))


def kernels_import_nothing_of_ours(root: Path) -> list[str]:
    return breaches(root, ["kernels"], ("pagefleet",),
                    allow=lambda name, relative: relative and under(name, "pagefleet.kernels"))


def control_plane_imports_no_worker(root: Path) -> list[str]:
    return breaches(root, ["operator", "gateway"], ("pagefleet.worker", "pagefleet.kernels"))


def worker_imports_no_control_plane(root: Path) -> list[str]:
    return breaches(root, ["worker"], ("pagefleet.operator", "pagefleet.gateway"))


WALLS = {
    "worker/core imports neither torch nor engine, executor, models or entrypoints": core_imports_no_engine_side,
    "only worker/entrypoints imports fastapi, pydantic, uvicorn or starlette": only_entrypoints_know_http,
    "kernels/ imports nothing of ours but its own modules, relatively": kernels_import_nothing_of_ours,
    "operator/ and gateway/ import neither pagefleet.worker nor pagefleet.kernels": control_plane_imports_no_worker,
    "worker/ imports neither pagefleet.operator nor pagefleet.gateway": worker_imports_no_control_plane,
}


@pytest.mark.parametrize("wall", list(WALLS))
def test_wall(wall):
    found = WALLS[wall](ROOT)
    assert not found, f"{wall}, but:\n" + "\n".join(found)


# ---- each wall catches a breach: a small tree with one of each


BREACHES = {
    "worker/core/sequence.py": "import torch\n",
    "worker/core/scheduler.py": "def f():\n    from ..executor import model_runner\n",
    "worker/engine/llm_engine.py": "from fastapi import FastAPI\n",
    "worker/entrypoints/api_server.py": "import fastapi\nimport pydantic\n",  # allowed here
    "kernels/attention.py": "from .rope import rotate_tile\nfrom pagefleet.kernels import norm\n"
                            "from .. import worker\n",
    "gateway/app.py": "from pagefleet.worker.core.sampling_params import SamplingParams\n",
    "operator/handlers.py": "import pagefleet.kernels.rope\n",
    "worker/models/llama.py": "from pagefleet import gateway\n",
}
EXPECTED = {
    core_imports_no_engine_side: ["worker/core/scheduler.py:2 imports pagefleet.worker.executor",
                                  "worker/core/scheduler.py:2 imports pagefleet.worker.executor.model_runner",
                                  "worker/core/sequence.py:1 imports torch"],
    only_entrypoints_know_http: ["worker/engine/llm_engine.py:1 imports fastapi",
                                 "worker/engine/llm_engine.py:1 imports fastapi.FastAPI"],
    kernels_import_nothing_of_ours: ["kernels/attention.py:2 imports pagefleet.kernels",
                                     "kernels/attention.py:2 imports pagefleet.kernels.norm",
                                     "kernels/attention.py:3 imports pagefleet",
                                     "kernels/attention.py:3 imports pagefleet.worker"],
    control_plane_imports_no_worker: ["gateway/app.py:1 imports pagefleet.worker.core.sampling_params",
                                      "gateway/app.py:1 imports pagefleet.worker.core.sampling_params.SamplingParams",
                                      "operator/handlers.py:1 imports pagefleet.kernels.rope"],
    worker_imports_no_control_plane: ["worker/models/llama.py:1 imports pagefleet.gateway"],
}


@pytest.mark.parametrize("wall", list(EXPECTED), ids=lambda f: f.__name__)
def test_each_wall_names_the_file_and_the_import_that_breach_it(tmp_path, wall):
    for rel, source in BREACHES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert wall(tmp_path) == EXPECTED[wall]


# ---- the torch-free core, imported for real


CORE_MODULES = [module_name(p, ROOT) for p in files(ROOT, "worker/core")]


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_loads_without_torch(module):
    probe = (f"import importlib, sys; importlib.import_module({module!r}); "
             "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'transformers'}); "
             "print(' '.join(bad)); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, f"importing {module} loads {done.stdout.strip() or done.stderr}"
