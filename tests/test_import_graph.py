"""The package layering docs/design.md states, checked on the source (ast: nothing is imported).

Edges are every import statement, wherever it stands: in a module's body, under an `if` /
`try`, and inside functions and classes (a deferred import is a dependency all the same),
but not under `if TYPE_CHECKING:` (annotations only). `from pkg import name` is an edge to
`pkg.name` when that is a module, else to `pkg` (its `__init__`), whose own re-exports are
edges to their targets. docs/design.md's layering table is this graph at package level
(`test_the_layering_table_is_the_graph`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "loopserve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, except in `if TYPE_CHECKING:` blocks."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        return [i for child in node.orelse for i in _imports(child)]
    return [i for child in ast.iter_child_nodes(node) for i in _imports(child)]


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        pkg = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {t for node in _imports(tree) for t in _targets(name, node)
                       if t in MODULES and t != name}
    return graph


GRAPH = _graph()


def _importers(package: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in GRAPH.items() if m == package or m.startswith(package + ".")}


def _in(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _offending(importer: str, imported: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, deps in _importers(importer).items()
                  for t in deps if any(_in(t, p) for p in imported))


def test_the_graph_sees_the_packages():
    assert {"loopserve.engine.engine_core", "loopserve.worker_host.host",
            "loopserve.decode_worker.worker", "loopserve.prefill_worker.worker"} <= set(GRAPH)
    assert "loopserve.worker_host.transfer_host" in GRAPH["loopserve.prefill_worker.worker"]
    assert "loopserve.scheduler.scheduler" in GRAPH["loopserve.scheduler"]  # an __init__ re-export
    assert "loopserve.cluster.ray_launcher" in GRAPH["loopserve.cluster.placement"]  # inside a function


def test_worker_packages_do_not_import_each_other():
    assert _offending("loopserve.decode_worker", ("loopserve.prefill_worker",)) == []
    assert _offending("loopserve.prefill_worker", ("loopserve.decode_worker",)) == []


def test_cluster_imports_no_worker_package():
    assert _offending("loopserve.cluster", ("loopserve.prefill_worker", "loopserve.decode_worker")) == []


def test_cluster_imports_no_front_end():
    assert _offending("loopserve.cluster", ("loopserve.entrypoints",)) == []


def test_model_imports_no_worker_package():
    assert _offending("loopserve.model", ("loopserve.prefill_worker", "loopserve.decode_worker",
                                          "loopserve.worker_host")) == []


def test_model_imports_neither_scheduler_nor_engine():
    assert _offending("loopserve.model", ("loopserve.scheduler", "loopserve.engine")) == []


def test_scheduler_invariants_import_one_way():
    """The checker reads the scheduler (its public view); nothing in loopserve/ imports the
    checker (tests call it)."""
    assert "loopserve.scheduler.scheduler" in GRAPH["loopserve.scheduler.invariants"]
    checker = "loopserve.scheduler.invariants"
    assert _offending("loopserve", (checker,)) == []


def _package(module: str) -> str:
    """`loopserve.cluster.router.core` -> `cluster`; the package's own `__init__` -> `loopserve`."""
    return module.split(".")[1] if "." in module else module


def _layering_table() -> dict[str, set[str]]:
    """docs/design.md's layering table: each row's packages -> what they import."""
    text = (ROOT.parent / "docs" / "design.md").read_text()
    rows = text.split("| package | imports |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    table: dict[str, set[str]] = {}
    for row in rows.splitlines():
        packages, imports = (cell.split("`")[1::2] for cell in row.strip("|").split("|"))
        for p in packages:
            table[p] = set(imports)
    return table


def test_the_layering_table_is_the_graph():
    graph: dict[str, set[str]] = {_package(m): set() for m in GRAPH}
    for m, deps in GRAPH.items():
        graph[_package(m)] |= {_package(t) for t in deps} - {_package(m)}
    table = _layering_table()
    assert sorted(table) == sorted(graph), "design.md's layering table lists other packages"
    wrong = {p: f"table {sorted(table[p])}, code {sorted(graph[p])}" for p in graph if table[p] != graph[p]}
    assert wrong == {}


def test_no_import_cycle():
    """Depth-first search; reports the first cycle found as a path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))
