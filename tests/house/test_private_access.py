"""No module reaches into another module's private state: ``x._name``, where ``x`` is not ``self`` or
``cls`` and ``_name`` is a private attribute, method or global that another module of the package defines,
nor ``from module import _name`` from a module of the package.

Read from the source by name (there are no types here): an attribute counts as another module's when the
accessing module defines no private name of that spelling and some other module of elastic_rm or launcher
does. Private names of third-party libraries are not judged here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "elastic_rm", ROOT / "launcher")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, globals, class attributes and the
    attributes its methods set on ``self`` or ``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {n for n in names if _is_private(n)}


def _reached(tree: ast.AST) -> dict[str, list[int]]:
    """``x._name`` accesses with ``x`` other than ``self``/``cls``: each name with its lines."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.setdefault(node.attr, []).append(node.lineno)
    return found


def _imported(tree: ast.AST) -> dict[str, list[int]]:
    """Private names imported from a module of the package (``from .x import _name``), with their lines."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        ours = isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] in ("elastic_rm", "launcher")
        )
        for alias in node.names if ours else ():
            if _is_private(alias.name):
                found.setdefault(alias.name, []).append(node.lineno)
    return found


def _foreign_accesses(trees: dict[str, ast.AST]) -> dict[str, dict[str, list[int]]]:
    """Per module, the private names it reaches that only other modules define, and the private names
    it imports from them, with their lines."""
    defined = {module: _defined(tree) for module, tree in trees.items()}
    out: dict[str, dict[str, list[int]]] = {}
    for module, tree in trees.items():
        for name, lines in _reached(tree).items():
            if name in defined[module]:
                continue
            if any(name in names for other, names in defined.items() if other != module):
                out.setdefault(module, {})[name] = lines
        for name, lines in _imported(tree).items():
            out.setdefault(module, {}).setdefault(name, []).extend(lines)
    return out


def _package_trees() -> dict[str, ast.AST]:
    return {
        _module_name(path): ast.parse(path.read_text(), str(path))
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
    }


def test_the_finder_sees_a_private_attribute_reached_from_another_module():
    owner = ast.parse(
        "class Client:\n    def __init__(self):\n        self._loop = 1\n        self.loop = 2\n"
    )
    user = ast.parse("def f(client):\n    client.loop\n    self_loop = client._loop\n")
    same = ast.parse("class W:\n    def __init__(self):\n        self._loop = 0\n\ndef g(w):\n    w._loop\n")
    importer = ast.parse("from .client import Client, _helper\nfrom os import _exit\n")
    trees = {"pkg.client": owner, "pkg.watch": user, "pkg.other": same, "pkg.importer": importer}
    assert _foreign_accesses(trees) == {"pkg.watch": {"_loop": [3]}, "pkg.importer": {"_helper": [1]}}


def test_no_module_touches_another_modules_private_state():
    found = _foreign_accesses(_package_trees())
    new = {
        f"{module}: {name} (line {', '.join(map(str, lines))})"
        for module, names in found.items()
        for name, lines in names.items()
    }
    assert not new, (
        "private attributes of another module's class reached (give the class a method or a declared "
        "interface instead): " + "; ".join(sorted(new))
    )
