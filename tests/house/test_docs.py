"""The docs are for users and describe the current code: a README a newcomer reads in one sitting, no
history of how the code came to be or how the work was organised (git log and CHANGELOG.md hold that), no
tracker numbers a clone cannot resolve, a license, and results files that say what they measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [
    p for d in ("elastic_rm", "launcher", "benchmarks", "tests", "examples") for p in (ROOT / d).rglob("*.py")
]

TRACKER = [re.compile(r"\bissues? ?#?\d+", re.I), re.compile(r"\(#\d+\)")]
TRACKER_IN_DOCS = [*TRACKER, re.compile(r"(?<![\w/-])#\d+\b")]  # etcd-io/etcd#14110 names upstream's
HISTORY = [
    re.compile(r"\b(previous|earlier) versions?\b", re.I),
    re.compile(r"\bthe version before\b", re.I),
    re.compile(r"\b(this|last|previous|earlier|next) session\b", re.I),
    re.compile(r"\b(since|before|after) the (last )?fix\b", re.I),
    re.compile(r"\bthe default then\b", re.I),
]


def offending(paths: list[Path], patterns: list[re.Pattern]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for p in paths
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for pattern in patterns
        for m in pattern.finditer(line)
    ]


def test_the_readme_reads_in_one_sitting():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move reference material into docs/"
    long = [n for n, line in enumerate(lines, 1) if len(line) > 200]
    assert long == [], f"README.md lines over 200 characters: {long}"


def test_the_benchmarks_page_is_current_results_only():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines"


def test_no_history_and_no_tracker_numbers_in_the_docs():
    assert offending(USER_DOCS, TRACKER_IN_DOCS + HISTORY) == []


def test_no_tracker_numbers_or_version_history_in_the_code():
    assert len(CODE) > 100
    assert offending(CODE, TRACKER + HISTORY[:2]) == []


def test_the_license_pyproject_declares_is_there():
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )


def test_every_results_file_says_what_it_measured():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    assert [f.name for f in files if f.name.startswith(("ab-", "diag-"))] == [], "one-off experiments: delete"
    missing = {}
    for f in files:
        body = json.loads(f.read_text())
        lacks = [k for k in ("commit", "date") if not str(body.get(k) or "")]
        if lacks:
            missing[f.name] = lacks
    assert missing == {}, "benchmarks.common.write_result records them; backfill older files from git log"
