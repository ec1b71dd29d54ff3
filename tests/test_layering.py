"""Imports go one way: the core, then master, worker, the simulator and the training run on it,
the command line on top; no module imports itself back through others (lazy imports inside
functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> installed package (pyproject's package-dir).
PACKAGES = {"hetconv": "hetconv", "master": "hetconv.master", "worker": "hetconv.worker",
            "simulations": "hetconv.simulations", "training": "hetconv.training",
            "cli": "hetconv.cli"}  # fmt: skip
#: The rooms above the core; the core (hetconv.*, but for them) imports none of them.
ROOMS = ("hetconv.master", "hetconv.worker", "hetconv.simulations", "hetconv.training",
         "hetconv.cli")  # fmt: skip
#: ``python -m hetconv`` runs the command line: the one core module that imports it.
ENTRY_POINT = "hetconv.__main__"


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "proto" in path.parts or (folder == "hetconv" and path.parts[-2] != "hetconv"
                                         and path.parent.name != "backends"):  # fmt: skip
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            module = node.module or ""
            if node.level:
                module = f"{base}.{module}" if module else base
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_the_graph_sees_the_project():
    graph = _graph()
    assert "hetconv.master.cluster" in graph and "hetconv.master.dispatch" in graph
    assert "hetconv.master.dispatch" in graph["hetconv.master.cluster"]
    assert "hetconv.backends" in graph["hetconv.conv"]
    assert "hetconv.training.loop" in graph and "hetconv.cli.train" in graph
    assert "hetconv.training" in graph["hetconv.cli.train"]


def test_rooms_import_only_downwards():
    rules = {
        "hetconv.master": ("hetconv.worker", "hetconv.simulations", "hetconv.training",
                           "hetconv.cli"),
        "hetconv.worker": ("hetconv.master", "hetconv.simulations", "hetconv.training",
                           "hetconv.cli"),
        "hetconv.simulations": ("hetconv.worker", "hetconv.training", "hetconv.cli"),
        "hetconv.training": ("hetconv.master", "hetconv.worker", "hetconv.simulations",
                             "hetconv.cli"),
    }  # fmt: skip
    bad = {}
    for name, imported in _graph().items():
        for room, forbidden in rules.items():
            if name.startswith(room + "."):
                wrong = sorted(m for m in imported if m.startswith(forbidden))
                if wrong:
                    bad[name] = wrong
    assert bad == {}


def test_the_core_imports_no_room_above_it():
    bad = {}
    for name, imported in _graph().items():
        in_core = name == "hetconv" or not name.startswith(ROOMS)
        if in_core and name != ENTRY_POINT:
            wrong = sorted(m for m in imported if m.startswith(ROOMS))
            if wrong:
                bad[name] = wrong
    assert bad == {}


def test_no_import_cycles():
    graph = _graph()
    cycles = []

    def visit(node: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in done:
                on_path.add(nxt)
                visit(nxt, path + [nxt], on_path, done)
                on_path.discard(nxt)
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start], {start}, done)
    assert cycles == []
