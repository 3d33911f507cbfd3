"""The library does not import the launcher: launcher/ parses, wires and prints on top of elastic_rm, so
anything a test, a benchmark or another front end needs lives in elastic_rm (an AST scan, with lazy
imports inside functions counted too)."""

from __future__ import annotations

import ast
import pathlib

from tests.conftest import REPO


def launcher_imports(source: str) -> list[int]:
    """Line numbers of the imports of `launcher` (or a module of it) in `source`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "launcher" or name.startswith("launcher.") for name in names):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_every_form_of_import():
    probe = (
        "import launcher\nimport os, launcher.demo as d\ndef f():\n    from launcher.commands import demo\n"
    )
    assert launcher_imports(probe) == [1, 2, 4]
    assert launcher_imports("from . import launcher\nimport launchers\nfrom elastic_rm import demo\n") == []


def test_no_module_of_elastic_rm_imports_launcher():
    modules = sorted(pathlib.Path(REPO, "elastic_rm").rglob("*.py"))
    assert len(modules) > 50
    found = {str(p.relative_to(REPO)): launcher_imports(p.read_text()) for p in modules}
    assert {path: lines for path, lines in found.items() if lines} == {}
