"""Every results file says what produced it: the commit measured, the date, the machine, the command
(benchmarks/common.py); a run's own file (the demo's, the soak's) gets the same when the harness copies it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from benchmarks.common import REPO, copy_result, write_result

ISO_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def head() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def test_a_result_records_commit_date_machine_and_command(tmp_path):
    got = json.loads(open(write_result("x", {"median_s": 1.5}, str(tmp_path))).read())
    assert got["benchmark"] == "x" and got["median_s"] == 1.5
    assert got["commit"] in (head(), head() + "-dirty")
    assert ISO_UTC.match(got["date"]), got["date"]
    assert (
        got["machine"]["cpus"] >= 1
        and got["machine"]["mem_gib"] > 0
        and isinstance(got["machine"]["gpus"], list)
    )
    assert "pytest" in got["command"]  # the command line as typed, here pytest's


def test_the_command_is_the_one_typed_with_its_module(tmp_path):
    code = f"from benchmarks.common import write_result; write_result('y', {{}}, {str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code, "--flag", "a b"], cwd=REPO, check=True, timeout=120)
    command = json.loads((tmp_path / "y.json").read_text())["command"]
    assert command.startswith(sys.executable) and command.endswith("--flag 'a b'"), command


def test_a_run_s_own_file_is_copied_with_the_run_s_date_and_machine(tmp_path):
    run = tmp_path / "work" / "demo.json"
    run.parent.mkdir()
    body = {
        "benchmark": "demo",
        "time": "2026-12-04T15:15:55Z",
        "wall_s": 94.0,
        "machine": {"load_avg_at_end": [1.0]},
    }
    run.write_text(json.dumps(body))
    got = json.loads(open(copy_result(run, "demo", str(tmp_path / "results"))).read())
    assert got["date"] == "2026-12-04T15:15:55Z" and "time" not in got and got["wall_s"] == 94.0
    assert got["machine"]["load_avg_at_end"] == [1.0] and got["machine"]["cpus"] >= 1
    assert got["commit"].startswith(head())


def test_the_load_average_is_recorded_as_the_benchmark_started_and_as_it_ended(tmp_path):
    """The load at the start is read when benchmarks.common is imported, before the benchmark's work,
    not when the file is written at the end (the two differ on a shared machine)."""
    code = (
        "import benchmarks.common as c; c.LOAD_AT_START = (9.5, 8.5, 7.5); "
        f"c.write_result('z', {{}}, {str(tmp_path)!r})"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
    recorded = json.loads((tmp_path / "z.json").read_text())["machine"]
    assert recorded["load_avg_at_process_start"] == [9.5, 8.5, 7.5]
    assert len(recorded["load_avg_when_written"]) == 3 and "load_avg_at_start" not in recorded
