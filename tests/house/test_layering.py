"""The layering of the package, read from the source: no import cycle, the launcher on top, ``wire`` below.

Every import counts: at module level, inside functions (they run, only later) and under ``if
TYPE_CHECKING:`` (they never run, but a type named across modules is a dependency all the same: a cycle
through one is two modules that each need the other to be understood).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elastic_rm"
SOURCES = (PACKAGE, ROOT / "launcher")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The elastic_rm/launcher modules that ``path`` imports (a ``from X import name`` counts as X.name
    when that is a module, else X)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m.split(".")[0] in ("elastic_rm", "launcher")}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for source in SOURCES for p in sorted(source.rglob("*.py"))}


def _module_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between modules. A package's ``__init__`` re-exporting its modules is not a dependency
    of those modules on it, so an import of its own package by a module inside it is left out."""
    return {
        m: {t for t in ts if t in graph and not (m.startswith(t + ".") and _is_package(t))}
        for m, ts in graph.items()
    }


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_package(module)) else ""


def _is_package(module: str) -> bool:
    return (ROOT / Path(*module.split(".")) / "__init__.py").exists()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same node, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := dfs(start)):
            return found
    return None


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` that hold a cycle: two or more nodes that reach
    each other, or a node that imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(component)

    for start in sorted(graph):
        if start not in index:
            connect(start)
    return components


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> str:
    """One cycle inside ``component``, written as a path, and the other modules caught in it."""
    path = _cycle({m: graph.get(m, set()) & component for m in component}) or []
    rest = sorted(component - set(path))
    return " -> ".join(path) + (f" (with {', '.join(rest)})" if rest else "")


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_cycle_finder_finds_every_cycle():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d", "x"}, "d": {"e"}, "e": {"c"}, "x": {"c"}, "f": {"f"}}
    found = _components(graph)
    assert sorted(map(sorted, found)) == [["a", "b"], ["c", "d", "e", "x"], ["f"]]
    assert _cycle_through(graph, {"c", "d", "e", "x"}) == "c -> d -> e -> c (with x)"
    assert _components({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_under_type_checking_and_in_functions_count(tmp_path, monkeypatch):
    package = tmp_path / "elastic_rm" / "pkg"
    package.mkdir(parents=True)
    for init in (tmp_path / "elastic_rm" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .b import f\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _imports(package / "a.py") == {"elastic_rm.pkg.b"}
    assert _imports(package / "b.py") == {"elastic_rm.pkg.a"}


def test_no_two_modules_import_each_other_through_any_path():
    edges = _module_edges(_graph())
    cycles = _components(edges)
    assert not cycles, (
        "import cycles (move what both modules need to the module that owns it, or pass it in): "
        + "; ".join(_cycle_through(edges, c) for c in cycles)
    )


def test_no_two_subpackages_import_each_other():
    sub_edges: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        if not module.startswith("elastic_rm."):
            continue
        a = _subpackage(module)
        for target in targets:
            b = _subpackage(target)
            if a and b and a != b and target.startswith("elastic_rm."):
                sub_edges.setdefault(a, set()).add(b)
    assert _cycle(sub_edges) is None, f"subpackage cycle: {' -> '.join(_cycle(sub_edges) or [])}"


def test_the_library_never_imports_the_launcher():
    offenders = {
        m: sorted(t for t in ts if t.split(".")[0] == "launcher")
        for m, ts in _graph().items()
        if m.split(".")[0] == "elastic_rm"
    }
    assert not {m: ts for m, ts in offenders.items() if ts}


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("elastic_rm.wire")))
def test_wire_depends_on_nothing_but_the_planners_plain_types(module):
    allowed = {"elastic_rm.wire", "elastic_rm.planner.interface"}
    for target in _graph()[module]:
        assert target in allowed or target.startswith("elastic_rm.wire."), f"{module} imports {target}"
