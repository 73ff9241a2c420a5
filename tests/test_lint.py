"""ruff over the repository ([tool.ruff] in pyproject.toml), one test per area so a failure says where.

An area is a top-level folder, or one package of worker/ or tests/ (worker/core, tests/engine, ...); files
at the root are the area ".". Every area must be clean: `ruff check --fix PATH` sorts imports, and long lines
are wrapped by hand.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ("worker", "tests")  # folders whose packages are areas of their own


def area_of(rel: str) -> str:
    parts = rel.split("/")
    if len(parts) == 1:
        return "."
    if parts[0] in SPLIT and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0]


def areas() -> list[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if not any(p.startswith(".") or p.endswith(".egg-info") for p in rel.parts):
            found.add(area_of(rel.as_posix()))
    return sorted(found)


@functools.cache
def violations() -> dict[str, list[str]]:
    """ruff's findings ("path:line:col: CODE message"), by area."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode not in (0, 1):  # 1: violations found; anything else: ruff itself failed
        raise RuntimeError(f"ruff check exited {done.returncode}:\n{done.stdout}{done.stderr}")
    by_area: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        path, sep, _ = line.partition(":")
        if sep and (ROOT / path).is_file():
            by_area.setdefault(area_of(path), []).append(line)
    return by_area


@pytest.mark.parametrize("area", areas())
def test_ruff_finds_nothing(area):
    found = violations().get(area, [])
    assert not found, f"ruff check finds {len(found)} in {area}/:\n" + "\n".join(found)
