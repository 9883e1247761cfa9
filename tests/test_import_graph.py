"""The package layering docs/design.md states, checked on the source (ast: nothing is imported).

Edges are module-level imports only: statements in a module's body, including those under a
module-level `if` / `try`, but not under `if TYPE_CHECKING:` and not inside functions or
classes (a deferred import runs after every module is loaded, so it cannot form a load-time
cycle). `from pkg import name` is an edge to `pkg.name` when that is a module, else to
`pkg` (its `__init__`), whose own re-exports are edges to their targets.
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


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level(node.body)
            found += _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _module_level(block)
    return found


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
        graph[name] = {t for node in _module_level(tree.body) for t in _targets(name, node)
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
    checker, at module level or deferred (tests call it)."""
    assert "loopserve.scheduler.scheduler" in GRAPH["loopserve.scheduler.invariants"]
    checker = "loopserve.scheduler.invariants"
    deferred = sorted(m for m, path in MODULES.items() if m != checker
                      for node in ast.walk(ast.parse(path.read_text(), str(path)))
                      if isinstance(node, (ast.Import, ast.ImportFrom)) and checker in _targets(m, node))
    assert _offending("loopserve", (checker,)) == [] and deferred == []


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
