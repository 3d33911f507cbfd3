"""One idea per module. A module may grow as large as its idea needs, but past SIZE_NEEDS_REASON lines its
docstring says why it is one module, on a line that starts with "Size:" (for example "Size: one state
machine; its states share every helper"). A large module without that line is a sign that it holds
several ideas, to be split along them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZE_NEEDS_REASON = 600


def size_reason(source: str) -> str | None:
    """The module docstring's "Size: ..." line (without the prefix), or None."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    for line in doc.splitlines():
        if line.strip().startswith("Size:"):
            reason = line.strip().removeprefix("Size:").strip()
            return reason or None
    return None


def unexplained(paths: list[Path]) -> dict[str, int]:
    """The modules over SIZE_NEEDS_REASON lines whose docstring gives no reason, with their sizes."""
    out = {}
    for path in paths:
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > SIZE_NEEDS_REASON and size_reason(source) is None:
            out[str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)] = lines
    return out


def test_every_large_module_says_why_it_is_one_module():
    paths = [p for package in ("elastic_rm", "launcher") for p in (ROOT / package).rglob("*.py")]
    assert len(paths) > 50  # the scan found the packages
    assert unexplained(paths) == {}, 'split these modules by idea, or say why not in a "Size:" docstring line'


def test_the_rule_asks_a_reason_only_past_the_threshold(tmp_path):
    body = "x = 1\n" * SIZE_NEEDS_REASON
    small = tmp_path / "small.py"
    small.write_text('"""An idea."""\n' + "x = 1\n" * (SIZE_NEEDS_REASON - 1))
    large = tmp_path / "large.py"
    large.write_text('"""An idea."""\n' + body)
    explained = tmp_path / "explained.py"
    explained.write_text('"""An idea.\n\nSize: one parser; its rules share one table.\n"""\n' + body)
    empty_reason = tmp_path / "empty.py"
    empty_reason.write_text('"""An idea.\n\nSize:\n"""\n' + body)
    found = unexplained([small, large, explained, empty_reason])
    assert set(found) == {str(large), str(empty_reason)}, found
