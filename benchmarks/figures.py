"""Figures quoted in README.md and docs/ come from results files: each carries an invisible marker.

    8.33 s<!-- fig: recovery.json results.ermrun/SIGKILL.median -->
    5.7x<!-- fig: recovery.json results.torchrun/SIGKILL.median / results.ermrun/SIGKILL.median -->

The marker names a file under benchmarks/results/ and a path into its JSON (keys joined by "."; a list
takes an index, min/max/median/mean of its numbers, or count: its length); "A / B" divides two values,
"A / B - 1" is the change from B to A. The number right before the marker must equal the value rounded to
the decimals the text shows, scaled by its unit (ms x1000, us x1e6, % x100, anything else as is; "in ms" at
the end of a marker gives the unit of a number written without one, as in 56-65 ms; a value under a key
ending in _ms or _us is stored in that unit). In the tables that quote results (TABLES) every number
outside the first column must carry a marker, so that a figure cannot be pasted in unchecked. Markers in
fenced code blocks are examples and are not checked.

A spec used in a long table row may be named once anywhere in the doc and used by its name:

    <!-- fig join8 = rendezvous.json join.elastic-rm/threads/N=8.median -->
    17 ms<!-- fig: @join8 -->

A run's date and commit carry a marker naming their file, checked against its `date` and `commit`:

    2026-12-01, 79126fa<!-- run: recovery.json -->

Every file in benchmarks/results/ must be quoted by a doc: a file nobody quotes is an old run to delete.

    .venv/bin/python -m benchmarks.figures            # check every marker; exit 1 on a stale figure
    .venv/bin/python -m benchmarks.figures --update   # rewrite every marked number from its file
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOCS = ("README.md", *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md"))))
# (file, text after which the table starts; None: every table of the file)
TABLES = (
    ("README.md", "Headline figures"),
    ("docs/benchmarks.md", None),
    ("docs/train.md", "## Costs measured here"),
    ("docs/train.md", "**Second baseline: torch's `dcp.async_save`.**"),
)

MARKER = re.compile(r"<!-- fig: (.*?) -->")
RUN = re.compile(r"(\d{4}-\d{2}-\d{2}), `?([0-9a-f]{7,40})`?<!-- run: (\S+?) -->")
RUN_MARKER = re.compile(r"<!-- run: (\S+?) -->")
NAMED = re.compile(r"<!-- fig ([\w-]+) = (.*?) -->")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
NUMBER = r"((?:(?<![^\s(|*])-)?(?<![\w.,])\d[\d,]*(?:\.\d+)?)"  # a minus only after a space or "("
FIGURE_BEFORE = re.compile(NUMBER + r"( ?(?:[A-Za-zµ%][A-Za-z/-]*)?)\**$")
ANY_NUMBER = re.compile(r"(?<![\w.,])-?\d[\d,]*(?:\.\d+)?")
SCALE = {"ms": 1e3, "us": 1e6, "µs": 1e6, "%": 100.0}
AGGREGATES = {"min": min, "max": max, "median": statistics.median, "mean": statistics.fmean}


@dataclass
class Figure:
    doc: str
    line: int
    spec: str
    text: str  # the number as the doc writes it
    unit: str
    start: int  # offset of the number in the doc
    stored: float = 1.0  # the file's unit: 1e3 for a key ending in _ms, 1e6 for _us, else 1 (seconds)
    value: float | None = None
    error: str | None = None

    def scaled(self) -> float:
        unit = self.unit.strip()
        return self.value * SCALE[unit] / self.stored if unit in SCALE else self.value

    def expected(self) -> str:
        """The file's value written with the doc's precision."""
        decimals = len(self.text.split(".")[1]) if "." in self.text else 0
        scaled = self.scaled()
        out = f"{scaled:,.{decimals}f}" if "," in self.text else f"{scaled:.{decimals}f}"
        return "0" if out in ("-0", "-0.0") and decimals == 0 else out

    @property
    def ok(self) -> bool:
        if self.error is not None or self.value is None:
            return False
        decimals = len(self.text.split(".")[1]) if "." in self.text else 0
        scaled = self.scaled()
        return abs(scaled - float(self.text.replace(",", ""))) <= 0.5 * 10**-decimals + 1e-9


def stored(spec: str) -> float:
    """The unit a value is stored in, from its key (`pause_ms`, `call_us`, or one above it: `cpu_ms.max`);
    anything else is seconds or a plain number (a ratio of two values is a plain number)."""
    expr = spec.partition(" ")[2]
    if " / " in expr:
        return 1.0
    units = [k[-3:] for k in expr.strip().split(".") if k.endswith(("_us", "_ms"))]
    return {"_us": 1e6, "_ms": 1e3}[units[-1]] if units else 1.0


def lookup(data: Any, path: str) -> float:
    """One value of a results file: keys joined by '.', list indices, list aggregates."""
    here = data
    for key in path.split("."):
        if isinstance(here, list) and key == "count":  # how many entries (of any kind) the list holds
            here = len(here)
        elif isinstance(here, list) and key in AGGREGATES:
            here = AGGREGATES[key]([float(x) for x in here])
        elif isinstance(here, list):
            here = here[int(key)]
        elif isinstance(here, dict) and key in here:
            here = here[key]
        else:
            raise KeyError(f"no {key!r} (of {path!r})")
    if isinstance(here, bool) or not isinstance(here, (int, float)):
        raise ValueError(f"{path!r} is {here!r}, not a number")
    return float(here)


def evaluate(spec: str, results: Path = RESULTS) -> float:
    """'file.json a.b', 'file.json a.b / c.d' (a ratio of two values of the same file) or
    'file.json a.b / c.d - 1' (a change: -0.07 is 7% less)."""
    name, _, expr = spec.partition(" ")
    change = expr.endswith(" - 1")
    expr = expr.removesuffix(" - 1")
    file = results / name
    if not file.is_file():
        raise FileNotFoundError(f"no results file benchmarks/results/{name}")
    data = json.loads(file.read_text())
    num, slash, den = expr.partition(" / ")
    value = lookup(data, num.strip())
    value = value / lookup(data, den.strip()) if slash else value
    return value - 1.0 if change else value


def figures(doc: str, text: str, results: Path = RESULTS) -> list[Figure]:
    """Every marked figure of one document, with its file's value (or why there is none); markers in
    fenced code blocks are examples, not figures."""
    out = []
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, no code
    named = {m.group(1): m.group(2) for m in NAMED.finditer(text)}
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        line_start = text.rfind("\n", 0, m.start()) + 1
        before = FIGURE_BEFORE.search(text[line_start : m.start()])
        raw = m.group(1)
        if raw.startswith("@"):
            name, _, rest = raw[1:].partition(" ")
            if name not in named:
                out.append(Figure(doc, line, raw, "", "", m.start(), error=f"no '<!-- fig {name} = ... -->'"))
                continue
            raw = f"{named[name]} {rest}".strip()
        spec, _, unit = raw.partition(" in ")  # "in ms": the unit of a range's first number
        if before is None:
            out.append(Figure(doc, line, spec, "", "", m.start(), error="no number right before"))
            continue
        unit = before.group(2) or unit
        fig = Figure(doc, line, spec, before.group(1), unit, line_start + before.start(1), stored(spec))
        try:
            fig.value = evaluate(spec, results)
        except (OSError, KeyError, ValueError, IndexError, ZeroDivisionError) as exc:
            fig.error = str(exc)
        out.append(fig)
    return out


def runs(doc: str, text: str, results: Path = RESULTS) -> list[str]:
    """Problems with the run markers of one document: each names a results file whose date and commit
    are the ones written before it."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    problems = []
    checked = {m.start(3) for m in RUN.finditer(text)}
    for m in RUN_MARKER.finditer(text):
        if m.start(1) not in checked:
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{doc}:{line}: a run marker needs 'YYYY-MM-DD, <commit>' right before it")
    for m in RUN.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        file = results / m.group(3)
        if not file.is_file():
            problems.append(f"{doc}:{line}: no results file benchmarks/results/{m.group(3)}")
            continue
        data = json.loads(file.read_text())
        date, commit = str(data.get("date", "")), str(data.get("commit", ""))
        if not date.startswith(m.group(1)) or not commit.startswith(m.group(2)):
            problems.append(
                f"{doc}:{line}: {m.group(1)}, {m.group(2)} ({m.group(3)}): the file says "
                f"{date[:10] or 'no date'}, {commit[:7] or 'no commit'}"
            )
    return problems


def quoted_files(texts: list[str]) -> set[str]:
    """The results files the documents name in a figure or run marker (examples in code blocks aside)."""
    names = set()
    for text in texts:
        text = FENCE.sub("", text)
        names |= {m.group(1).partition(" ")[0] for m in MARKER.finditer(text)}
        names |= {m.group(2).partition(" ")[0] for m in NAMED.finditer(text)}
        names |= {m.group(1) for m in RUN_MARKER.finditer(text)}
    return names


def tables(text: str, after: str | None) -> list[tuple[int, str]]:
    """(line number, row) of the body rows of the tables in text (after the anchor: its first table)."""
    lines = text.splitlines()
    first = 0
    if after is not None:
        first = next((i for i, ln in enumerate(lines) if after in ln), None)
        if first is None:
            raise ValueError(f"anchor {after!r} not found")
    rows, in_table = [], False
    for i in range(first, len(lines)):
        line = lines[i]
        if not line.startswith("|"):
            if in_table and after is not None:
                break
            in_table = False
            continue
        in_table = True
        header = i + 1 < len(lines) and re.match(r"^\|\s*-{3}", lines[i + 1])
        if not header and not re.match(r"^\|\s*-{3}", line):
            rows.append((i + 1, line))
    return rows


def unmarked(row: str) -> list[str]:
    """Numbers in the cells after the first one of a table row that carry no marker."""
    cells = row.strip().strip("|").split("|")
    bad = []
    for cell in cells[1:]:
        parts = MARKER.split(re.sub(r"`[^`]*`", "", RUN.sub("", cell)))
        for k in range(0, len(parts), 2):
            segment = parts[k]
            marked = FIGURE_BEFORE.search(segment) if k + 1 < len(parts) else None
            plain = segment[: marked.start(1)] if marked else segment
            bad += ANY_NUMBER.findall(plain)
    return bad


def check(
    repo: Path = REPO,
    results: Path = RESULTS,
    docs: tuple[str, ...] = DOCS,
    table_specs: tuple[tuple[str, str | None], ...] = TABLES,
) -> list[str]:
    """Everything wrong with the quoted figures, one line each; empty when all agree with their files."""
    problems = []
    texts = []
    for doc in docs:
        text = (repo / doc).read_text()
        texts.append(text)
        for f in figures(doc, text, results):
            if not f.ok:
                why = f.error or f"the file says {f.expected()}{f.unit}"
                problems.append(f"{doc}:{f.line}: {f.text}{f.unit} ({f.spec}): {why}")
        problems += runs(doc, text, results)
    for doc, after in table_specs:
        for line, row in tables((repo / doc).read_text(), after):
            for number in unmarked(row):
                problems.append(f"{doc}:{line}: {number} in a results table has no fig marker")
    quoted = quoted_files(texts)
    for file in sorted(results.glob("*.json")):
        if file.name not in quoted:
            problems.append(f"benchmarks/results/{file.name}: quoted by no doc (an old run: delete it)")
    return problems


def update(repo: Path = REPO, results: Path = RESULTS, docs: tuple[str, ...] = DOCS) -> int:
    """Rewrite every marked number from its file, with the precision the doc uses, and every run's date
    and commit; returns how many."""
    changed = 0
    for doc in docs:
        path = repo / doc
        text = path.read_text()
        stale = [f for f in figures(doc, text, results) if f.error is None and not f.ok]
        for f in reversed(stale):  # from the end, so that earlier offsets stay valid
            start, new = f.start, f.expected()
            if new.startswith("-") and text[start - 1 : start] == "+":  # "+3.2%" turned negative: "-3.4%"
                start -= 1
            text = text[:start] + new + text[f.start + len(f.text) :]
        text, runs_changed = _update_runs(text, results)
        if stale or runs_changed:
            path.write_text(text)
            changed += len(stale) + runs_changed
    return changed


def _update_runs(text: str, results: Path) -> tuple[str, int]:
    """Each run marker's date and commit rewritten from its file (code blocks hold examples: left)."""
    code = [m.span() for m in FENCE.finditer(text)]
    changed = 0

    def stamp(m: re.Match) -> str:
        nonlocal changed
        file = results / m.group(3)
        if any(a <= m.start() < b for a, b in code) or not file.is_file():
            return m.group(0)
        data = json.loads(file.read_text())
        date, commit = str(data.get("date", ""))[:10], str(data.get("commit", ""))[:7]
        if not date or not commit or (date, commit) == (m.group(1), m.group(2)):
            return m.group(0)
        changed += 1
        return f"{date}, {commit}<!-- run: {m.group(3)} -->"

    return RUN.sub(stamp, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__.split("\n")[0])
    ap.add_argument("--update", action="store_true", help="rewrite stale figures from their files")
    args = ap.parse_args(argv)
    if args.update:
        print(f"rewrote {update()} figure(s); words around them (met, faster) are yours to check")
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)" if problems else "every quoted figure agrees with its results file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
