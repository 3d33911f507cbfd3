"""Trace CSVs a user can make that load_trace let through or answered with a traceback: a byte order mark
(a spreadsheet's export), a misspelt optional column, a 400-digit number, a row whose job description the
planner refuses (found minutes into the simulation before)."""

from __future__ import annotations

import csv

import pytest

from elastic_rm.planner.sim.trace import TraceError, load_trace, write_trace
from elastic_rm.planner.sim.tracegen import generate
from launcher.erm import main


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    path = tmp_path_factory.mktemp("trace") / "t.csv"
    write_trace(str(path), generate(2, 1))
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path, rows: list[dict], prefix: str = "") -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(prefix)
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, rows):
    """It read as column '\\ufeffjob_id': "missing column(s) job_id" for a file that has it."""
    jobs = load_trace(_write(tmp_path / "bom.csv", rows, prefix="\ufeff"))
    assert sorted(j.job_id for j in jobs) == sorted(r["job_id"] for r in rows)


def test_a_misspelt_optional_column_is_an_error_naming_the_closest(tmp_path, rows):
    """ "warmup" for "warmup_s" silently simulated every job without its warm-up."""
    renamed = [{("warmup" if k == "warmup_s" else k): v for k, v in r.items()} for r in rows]
    with pytest.raises(TraceError, match=r"typo.csv:1: unknown column 'warmup'; did you mean 'warmup_s'\?"):
        load_trace(_write(tmp_path / "typo.csv", renamed))


@pytest.mark.parametrize(
    "column, value, needle",
    [
        ("rows_per_table", "9" * 400, "field 'rows_per_table': must be > 0"),  # OverflowError in isfinite
        ("bandwidth", "0.5", "field 'bandwidth' must be >= 1.0"),  # JobSpecError mid-simulation
        ("req_mem_gib_per_node", "1e300", "req_mem_gib_per_node"),  # OverflowError mid-simulation
        ("rows_per_table", str(10**30), "field 'rows' must be <= 1e+18"),
    ],
)
def test_a_bad_row_is_a_trace_error_naming_the_line(tmp_path, rows, column, value, needle):
    bad = [dict(rows[0], **{column: value}), rows[1]]
    path = _write(tmp_path / "bad.csv", bad)
    with pytest.raises(TraceError, match="bad.csv:2: ") as info:
        load_trace(path)
    assert needle in str(info.value)


def test_simulate_refuses_a_row_the_planner_refuses_before_simulating(tmp_path, capsys, rows):
    path = _write(tmp_path / "bad.csv", [dict(rows[0], bandwidth="0.5"), rows[1]])
    rc = main(["simulate", "--trace", path, "--no-plots", "--out", str(tmp_path / "o")])
    out = capsys.readouterr()
    assert rc == 2 and "bad.csv:2: " in out.err and "bandwidth" in out.err, out.err
    assert "Traceback" not in out.err and not (tmp_path / "o").exists()


def test_a_column_given_twice_is_an_error(tmp_path, rows):
    header = ",".join(rows[0]) + ",dim"
    lines = [header] + [",".join(r.values()) + ",8" for r in rows]
    path = tmp_path / "twice.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="twice.csv:1: column 'dim' appears twice"):
        load_trace(str(path))
