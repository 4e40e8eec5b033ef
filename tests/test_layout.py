"""The layout's rules (docs/architecture.md, "What may import what"), checked on the source.

Each rule is read from the code's own imports (ast), so a change that breaks one
fails here with the module and the import named, before it blurs the rooms.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = sorted([*ROOT.joinpath("coordinator").rglob("*.py"), *ROOT.joinpath("workers").rglob("*.py")])
# The seams the execution plane may use: the package surface, the run lifecycle, the app and task
# names, the reconciler, and the trace spans its run hooks open (coordinator/tracing.py).
WORKER_SEAMS = {
    "coordinator",
    "coordinator.runs",
    "coordinator.celery_app",
    "coordinator.reconciler",
    "coordinator.outbound",
    "coordinator.tracing",
    "coordinator.loading",  # how a process loads its modules (the collector off), shared with the CLI
    "coordinator.networks",  # the ranges no connection may reach, a webhook's or a sandbox's (standard library alone)
}
# The one module outside the store package that builds a Store.
STORE_BUILDER = "coordinator/service.py"
# The one other module that names the Store: the plane, the parts the service hands its rooms.
STORE_HOLDER = "coordinator/plane.py"
# Faces call the Coordinator's operations, never its store, nor the plane it hands its rooms.
FACES = ["coordinator/api", "coordinator/cli", "coordinator/web", "workers"]
# How deep the map in docs/architecture.md nests folders (coordinator/store/lua/ is 3).
MAP_DEPTH = 3
# The import cycles the code has, each a debt to pay: none. No cycle may appear, and a listed
# one may only shrink; remove its entry once it is gone. Type-checking imports count:
# a cycle a type checker needs is one a reader has to hold in mind too.
KNOWN_CYCLES: list[set[str]] = []


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
    if name.startswith("coordinator/store/") or name in (STORE_BUILDER, STORE_HOLDER):
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
    assert ".plane." not in text, f"{_name(path)} touches the rooms' parts"


def test_one_write_back_entry_point() -> None:
    defined = [_name(p) for p in SOURCE if "def write_back(" in p.read_text(encoding="utf-8")]
    assert defined == ["coordinator/writeback.py"]
    callers = {_name(p) for p in SOURCE if "write_back(" in p.read_text(encoding="utf-8")} - set(defined)
    # The reconciler's repair of an ended task goes through `writeback.settle_ended`, as a redelivery's does.
    assert callers == {
        "coordinator/runs.py",
        "coordinator/control.py",
    }


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the subq modules it imports: `from pkg import name` counts as `pkg.name` where that is a module."""
    modules = {_module_of(path): path for path in SOURCE}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[module] = {found for target in targets if (found := resolve(target)) not in (None, module)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    search = _Tarjan(graph)
    for start in graph:
        if start not in search.index:
            search.from_module(start)
    return [component for component in search.components if len(component) > 1]


class _Tarjan:
    """Tarjan's search over an import graph: each module's discovery index and low link, the stack of modules
    whose component is still open, and the components closed so far."""

    def __init__(self, graph: dict[str, set[str]]) -> None:
        self.graph = graph
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.components: list[set[str]] = []

    def from_module(self, start: str) -> None:
        """Depth first from `start`, on a list of (module, edges left) rather than by recursion."""
        work = [(start, self._enter(start))]
        while work:
            node, edges = work[-1]
            target = self._next_unvisited(node, edges)
            if target is not None:
                work.append((target, self._enter(target)))
                continue
            work.pop()
            if work:  # the module that reached `node` reaches what it reaches
                above = work[-1][0]
                self.low[above] = min(self.low[above], self.low[node])
            if self.low[node] == self.index[node]:
                self.components.append(self._close(node))

    def _enter(self, node: str) -> Iterator[str]:
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        self.on_stack.add(node)
        return iter(sorted(self.graph[node]))

    def _next_unvisited(self, node: str, edges: Iterator[str]) -> str | None:
        """The next module `node` imports that is not visited yet (None: no more); an import of a module whose
        component is still open lowers `node`'s low link on the way."""
        for target in edges:
            if target not in self.index:
                return target
            if target in self.on_stack:
                self.low[node] = min(self.low[node], self.index[target])
        return None

    def _close(self, node: str) -> set[str]:
        """The component `node` is the root of: the stack's modules down to it."""
        component = set()
        while True:
            member = self.stack.pop()
            self.on_stack.discard(member)
            component.add(member)
            if member == node:
                return component


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_new_import_cycle() -> None:
    """No import cycle, type-checking imports included, beyond the known ones (which may only shrink)."""
    graph = _import_graph()
    assert "coordinator.service" in graph["coordinator.runs"], "the graph lost a type-checking import"
    for cycle in _cycles(graph):
        assert any(cycle <= known for known in KNOWN_CYCLES), f"an import cycle: {sorted(cycle)}"


def _map_of_the_tree() -> set[str]:
    """The modules docs/architecture.md's map names, as paths (the map's indentation is the folders)."""
    doc = ROOT.joinpath("docs", "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("## The map") :]
    block = section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]
    folders: list[str] = []
    named: set[str] = set()
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent % 2 or indent > 2 * MAP_DEPTH:  # a description's second line
            continue
        level = indent // 2
        for name in line.strip().split("  ")[0].split(" "):
            if name.endswith("/"):
                folders[level:] = [name.rstrip("/")]
            elif name.endswith(".py"):
                named.add("/".join([*folders[:level], name]))
    return named


def test_the_map_names_every_module_where_it_is() -> None:
    """Every module is in the map, in its folder, and the map names no module that is gone."""
    named = _map_of_the_tree()
    modules = {_name(path) for path in SOURCE if path.name != "__init__.py"}  # a package is named by its folder
    assert sorted(modules - named) == [], "modules missing from docs/architecture.md's map"
    assert sorted(named - {_name(path) for path in SOURCE}) == [], "the map names modules that are not in the tree"


# Public store methods that send no command of their own: pure, or through a method that translates.
TRANSLATED_THROUGH_ANOTHER = {
    "coordinator.store.convergence.ConvergenceStore.unwatch_ended",  # unwatch
    "coordinator.store.outbox.OutboxStore.hooks_mapping",  # pure
    "coordinator.store.records.RecordStore.ancestors",  # task_field
}


def test_every_public_store_method_turns_redis_errors_into_subqs() -> None:
    """A Redis error that escapes as redis-py's (unwatch_parked's did) is no StoreError: a worker's task did not
    retry on it (`autoretry_for=(StoreError,)`), the API answered 500, not 503."""
    import importlib
    import inspect
    import pkgutil

    import coordinator.store as store

    bare = []
    for found in pkgutil.iter_modules(store.__path__):
        module = importlib.import_module(f"coordinator.store.{found.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not name.endswith("Store"):
                continue
            for attr, function in vars(cls).items():
                qualified = f"{module.__name__}.{name}.{attr}"
                if attr.startswith("_") or not inspect.isfunction(function) or qualified in TRANSLATED_THROUGH_ANOTHER:
                    continue
                if not hasattr(function, "__wrapped__"):  # translate_redis_errors wraps it (functools.wraps)
                    bare.append(qualified)
    assert bare == [], f"not wrapped in translate_redis_errors: {bare}"
