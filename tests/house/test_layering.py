"""The layering of the package, read from the source: no import cycle, the launcher on top, ``wire`` below.

Imports under ``if TYPE_CHECKING:`` are left out (they never run); imports inside functions count (they
do run, only later).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elastic_rm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """The elastic_rm/launcher modules that ``path`` imports (a ``from X import name`` counts as X.name
    when that is a module, else X)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


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


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_two_modules_import_each_other_through_any_path():
    graph = _graph()
    # a package's __init__ re-exporting its modules is not a dependency of those modules on it
    edges = {m: {t for t in ts if t in graph and not (m.startswith(t + ".") and _is_package(t))}
             for m, ts in graph.items()}  # fmt: skip
    assert _cycle(edges) is None, f"import cycle: {' -> '.join(_cycle(edges) or [])}"


def test_no_two_subpackages_import_each_other():
    sub_edges: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        a = _subpackage(module)
        for target in targets:
            b = _subpackage(target)
            if a and b and a != b and target.startswith("elastic_rm."):
                sub_edges.setdefault(a, set()).add(b)
    assert _cycle(sub_edges) is None, f"subpackage cycle: {' -> '.join(_cycle(sub_edges) or [])}"


def test_the_library_never_imports_the_launcher():
    offenders = {m: sorted(t for t in ts if t.split(".")[0] == "launcher") for m, ts in _graph().items()}
    assert not {m: ts for m, ts in offenders.items() if ts}


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("elastic_rm.wire")))
def test_wire_depends_on_nothing_but_the_planners_plain_types(module):
    allowed = {"elastic_rm.wire", "elastic_rm.planner.interface"}
    for target in _graph()[module]:
        assert target in allowed or target.startswith("elastic_rm.wire."), f"{module} imports {target}"
