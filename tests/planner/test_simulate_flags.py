"""`erm simulate` flags out of range: said at once with the flag's name (exit 2), not a traceback and not
silently replaced."""

from __future__ import annotations

import pytest

from elastic_rm.planner.sim.trace import write_trace
from elastic_rm.planner.sim.tracegen import generate
from launcher.erm import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", "--no-plots", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_negative_seed_is_refused(tmp_path, capsys):
    """numpy raised "expected non-negative integer" from inside the trace generator."""
    rc, out, err = run(capsys, "--generate", "3", "--seed", "-1", "--out", str(tmp_path / "o"))
    assert rc == 2 and "--seed must be >= 0" in err and "jobs from" not in out, err


@pytest.mark.parametrize("flag", ["--fail-rate", "--straggler-rate"])
def test_a_negative_rate_is_refused_not_taken_as_zero(tmp_path, capsys, flag):
    rc, out, err = run(capsys, "--generate", "3", flag, "-0.5", "--out", str(tmp_path / "o"))
    assert rc == 2 and f"{flag} must be a finite number >= 0" in err and "jobs from" not in out, err


@pytest.mark.parametrize(
    "flags", [["--write-trace", "copy.csv"], ["--load", "0.5"], ["--family", "comm-bound"]]
)
def test_a_generator_flag_with_a_trace_file_is_refused_not_ignored(tmp_path, capsys, flags, monkeypatch):
    """The trace was simulated as is: no copy written, the load and the family silently not applied."""
    monkeypatch.chdir(tmp_path)
    write_trace("t.csv", generate(2, 1))
    rc, out, err = run(capsys, "--trace", "t.csv", *flags, "--out", "o")
    assert rc == 2 and f"{flags[0]}: for a generated trace, not with --trace" in err, err
    assert "jobs from" not in out and not (tmp_path / "copy.csv").exists()
