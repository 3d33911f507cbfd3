"""Code and docs name only files a clone has: no pointer to notes that live outside the repository.

Why: a user's clone has none of them, so such a pointer explains nothing; state the fact, or point at a
file in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".json", ".yml", ".yaml"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
OUTSIDE = re.compile(
    r"DESIGN\.md|anchors\.md|feasibility\.md|dlrover-rm\.md|baselines\.md|\breference/|\.\./shared"
)


def _text_files() -> list[Path]:
    """Source, docs and build files (the CI script under .ci too), outside caches and the venv."""
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(p in SKIP_DIRS for p in rel.parts) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name == "Makefile" or rel.parts[0] == ".ci":
            found.append(path)
    return found


def test_the_scan_sees_the_code_and_the_docs():
    names = {p.relative_to(ROOT).as_posix() for p in _text_files()}
    assert {"README.md", "docs/train.md", "elastic_rm/agent/agent.py"} <= names


def test_no_file_points_outside_the_repository():
    me = Path(__file__).resolve()
    hits = []
    for path in _text_files():
        if path.resolve() == me:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)
