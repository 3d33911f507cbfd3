"""`ruff format` owns the layout: no ``# fmt: skip`` in elastic_rm/ or launcher/ except on a literal table,
a list, tuple, set or dict display laid out by hand in rows (an argv of flag-value pairs, say). Anything
else that reads better by hand reads as well split the way ruff splits it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "elastic_rm", ROOT / "launcher")
MARK = "fmt: skip"
TABLES = (ast.List, ast.Tuple, ast.Set, ast.Dict)


def _misplaced(source: str) -> list[int]:
    """Lines whose ``# fmt: skip`` ends something other than a literal table."""
    table_ends = {n.end_lineno for n in ast.walk(ast.parse(source)) if isinstance(n, TABLES)}
    comments = [
        t.start[0]
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT and MARK in t.string
    ]
    return [line for line in comments if line not in table_ends]


def test_the_finder_tells_a_table_from_a_call():
    source = 'argv = [\n    "--a", "1",\n    "--b", "2",\n]  # fmt: skip\nf(1,\n  2)  # fmt: skip\n'
    assert _misplaced(source) == [6]


def test_fmt_skip_only_on_literal_tables():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        for line in _misplaced(path.read_text())
    ]
    assert not found, (
        "`# fmt: skip` outside a literal table (remove it and let `ruff format` lay the code out): "
        + ", ".join(found)
    )


LINE_LIMIT = 110


def test_no_line_over_110_characters():
    """ruff's E501 does not count a trailing pragma (``# noqa: ...``, ``# type: ignore``), so a line it
    passes may still run past the limit; here every character counts."""
    found = [
        f"{path.relative_to(ROOT)}:{number} ({len(line)})"
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > LINE_LIMIT
    ]
    assert not found, f"lines over {LINE_LIMIT} characters (wrap them; a pragma counts): " + ", ".join(found)
