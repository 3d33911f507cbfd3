"""The seams between the package's parts are declared: a parameter that holds an object other modules act
on (the agent, an etcd client, a node session, a rendezvous handler, its node services, a round policy, a
store or a view) names its type or a Protocol, never ``Any``: a reader then sees what the function may use
of it, and a renamed member is a name that no longer exists rather than a silent getattr miss.

Read from the source by parameter name (there are no types here).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "elastic_rm", ROOT / "launcher")
SEAMS = {"agent", "client", "session", "handler", "services", "policy", "store", "view"}


def _is_any(annotation: ast.expr | None) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() in ("Any", "typing.Any")
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    return isinstance(annotation, ast.Attribute) and annotation.attr == "Any"


def _undeclared(tree: ast.AST) -> list[tuple[str, int]]:
    """(parameter, line) of each seam parameter annotated ``Any``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            found += [(p.arg, p.lineno) for p in params if p.arg in SEAMS and _is_any(p.annotation)]
    return found


def test_the_finder_sees_a_seam_typed_any():
    tree = ast.parse(
        "def f(agent: Any, client: typing.Any, n: Any, view: 'Any', session: Session):\n    pass\n"
    )
    assert _undeclared(tree) == [("agent", 1), ("client", 1), ("view", 1)]


def test_no_seam_parameter_is_typed_any():
    found = [
        f"{path.relative_to(ROOT)}:{line} ({name})"
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        for name, line in _undeclared(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, (
        "parameters that hold another part's object typed Any (name its class, or declare a Protocol of "
        "what the function uses): " + "; ".join(found)
    )
