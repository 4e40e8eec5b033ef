"""The layout's rules (docs/architecture.md, "What may import what"), checked on the source.

Each rule is read from the code's own imports (ast), so a change that breaks one
fails here with the module and the import named, before it blurs the rooms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = sorted([*ROOT.joinpath("coordinator").rglob("*.py"), *ROOT.joinpath("workers").rglob("*.py")])
# The seams the execution plane may use: the package surface, the run lifecycle, the app and task
# names, the reconciler, what makes the worker's app Flower's (workers/flower.py), and the
# worker's own Prometheus counters (coordinator/metrics.py).
WORKER_SEAMS = {
    "coordinator",
    "coordinator.runs",
    "coordinator.celery_app",
    "coordinator.reconciler",
    "coordinator.flower",
    "coordinator.metrics",
}
# The one module outside the store package that builds a Store.
STORE_BUILDER = "coordinator/service.py"
# Faces call the Coordinator's operations, never its store.
FACES = ["coordinator/api", "coordinator/cli", "coordinator/web", "workers"]
# Small modules: a reader holds one in mind. A size gate splits cohesive modules to pass it
# (run.py, runs.py, run_outcomes.py); the one-house issue replaces it with gates on structure
# (import cycles, faces past the service). Until then 420: the service gained the health
# check's read and the web sessions' part, `subq up` its credentials file, none a reason to split.
MAX_MODULE_LINES = 420


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imports(path: Path) -> list[str]:
    """Every module the file imports (absolute), at any depth, type-checking imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def test_the_source_is_found() -> None:
    assert len(SOURCE) > 40 and any(_name(p) == STORE_BUILDER for p in SOURCE)


@pytest.mark.parametrize("path", [p for p in SOURCE if _name(p).startswith("workers/")], ids=_name)
def test_workers_import_only_the_coordinators_seams(path: Path) -> None:
    reached = {m for m in _imports(path) if m.split(".")[0] == "coordinator"}
    # `from coordinator import X` lists `coordinator.X` too: a name of the surface, not a module.
    modules = {m for m in reached if m in WORKER_SEAMS or not m.startswith("coordinator.") or _is_module(m)}
    assert modules <= WORKER_SEAMS, f"{_name(path)} imports {sorted(modules - WORKER_SEAMS)}"


def _is_module(dotted: str) -> bool:
    relative = Path(*dotted.split("."))
    return ROOT.joinpath(relative).with_suffix(".py").exists() or ROOT.joinpath(relative, "__init__.py").exists()


@pytest.mark.parametrize("path", [p for p in SOURCE if _name(p).startswith("coordinator/")], ids=_name)
def test_only_the_store_and_the_service_import_the_store(path: Path) -> None:
    name = _name(path)
    if name.startswith("coordinator/store/") or name == STORE_BUILDER:
        return
    store = [m for m in _imports(path) if m == "coordinator.store" or m.startswith("coordinator.store.")]
    assert store == [], f"{name} imports {store}"


@pytest.mark.parametrize("path", [p for p in SOURCE if _name(p).startswith("coordinator/")], ids=_name)
def test_the_coordinator_never_imports_workers(path: Path) -> None:
    assert not [m for m in _imports(path) if m.split(".")[0] == "workers"], _name(path)


@pytest.mark.parametrize("path", [p for p in SOURCE if _name(p).startswith(tuple(FACES))], ids=_name)
def test_faces_never_reach_past_the_service(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert ".store." not in text and ".store)" not in text, f"{_name(path)} touches the store"


def test_one_write_back_entry_point() -> None:
    defined = [_name(p) for p in SOURCE if "def write_back(" in p.read_text(encoding="utf-8")]
    assert defined == ["coordinator/writeback.py"]
    callers = {_name(p) for p in SOURCE if "write_back(" in p.read_text(encoding="utf-8")} - set(defined)
    assert callers == {
        "coordinator/run.py",
        "coordinator/runs.py",
        "coordinator/control.py",
        "coordinator/reconciler.py",
    }


@pytest.mark.parametrize("path", SOURCE, ids=_name)
def test_no_module_is_over_the_limit(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines"
