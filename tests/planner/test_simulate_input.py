"""`erm simulate`: a bad output path or a non-finite number is a usage error (exit 2, a message naming the
flag) said before the simulation runs; an output that fails at write time is a message, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from launcher.erm import main
from tests.conftest import BIN, REPO


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["simulate", "--generate", "5", "--no-plots", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _not_simulated(out: str) -> bool:
    return "jobs from generated" not in out  # the line printed once the simulation ran


@pytest.mark.parametrize(
    "flag", ["--tick", "--load", "--cores", "--mem-gib", "--fail-rate", "--straggler-rate"]
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_number_is_refused(tmp_path, capsys, flag, value):
    rc, out, err = run(capsys, "--out", str(tmp_path / "o"), flag, value)
    assert rc == 2 and f"{flag} must be a finite number" in err, (rc, err)
    assert _not_simulated(out) and not (tmp_path / "o").exists()


def test_write_trace_into_a_missing_directory_is_refused_before_simulating(tmp_path, capsys):
    target = tmp_path / "nonexistent" / "dir" / "t.csv"
    rc, out, err = run(capsys, "--out", str(tmp_path / "o"), "--write-trace", str(target))
    assert rc == 2 and f"--write-trace {target}: its directory" in err and "does not exist" in err, err
    assert "Traceback" not in err and _not_simulated(out) and not (tmp_path / "o").exists()


def test_write_trace_onto_a_directory_is_refused(tmp_path, capsys):
    rc, out, err = run(capsys, "--out", str(tmp_path / "o"), "--write-trace", str(tmp_path))
    assert rc == 2 and f"--write-trace {tmp_path}: is a directory" in err and _not_simulated(out), err


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_out_that_cannot_be_a_directory_is_refused_before_simulating(tmp_path, capsys, where):
    existing = tmp_path / "result.txt"
    existing.write_text("precious")
    out_dir = existing if where == "file" else existing / "sim"
    rc, out, err = run(capsys, "--out", str(out_dir))
    assert rc == 2 and f"--out {out_dir}: " in err and "not a directory" in err, err
    assert "Traceback" not in err and _not_simulated(out) and existing.read_text() == "precious"


def test_out_that_fails_at_write_time_is_a_message(tmp_path, capsys):
    out_dir = tmp_path / "o"
    (out_dir / "result.json").mkdir(parents=True)  # passes the check up front; writing result.json fails
    rc, out, err = run(capsys, "--out", str(out_dir))
    assert rc == 1 and f"--out {out_dir}: cannot write the results" in err, err
    assert "Traceback" not in err and not _not_simulated(out)


def test_write_trace_that_fails_at_write_time_is_a_message(tmp_path, capsys):
    rc, _, err = run(capsys, "--out", str(tmp_path / "o"), "--write-trace", "/dev/full")  # ENOSPC
    assert rc == 1 and "--write-trace /dev/full: cannot write it" in err and "Traceback" not in err, err


def test_a_reader_that_left_ends_the_output_quietly_and_the_results_are_still_written(tmp_path):
    """`erm simulate ... | head -1`: no traceback, exit status 1, and result.json written all the same."""
    out = tmp_path / "sim"
    argv = [os.path.join(BIN, "erm"), "simulate", "--generate", "8", "--no-plots", "--out", str(out)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout is not None
    p.stdout.close()  # the reader left before the first line
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1 and err == "", (p.returncode, err[-2000:])
    assert json.loads((out / "result.json").read_text())["policies"]
