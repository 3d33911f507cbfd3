"""benchmarks/ranks.py: the benchmarks' rank launcher starts real processes, waits for them, and leaves
none behind when one fails or the deadline passes (with the failed rank's log tail in the error)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from benchmarks.ranks import run_ranks


def run(tmp_path: Path, actions: list[str], timeout: float = 60.0) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"workdir": str(tmp_path), "actions": actions}))
    run_ranks("tests.rank_probe", spec, len(actions), timeout, lambda r: tmp_path / f"log-{r}.txt", "probe")


def alive(tmp_path: Path, rank: int) -> bool:
    pid = int((tmp_path / f"pid-{rank}").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_rank_runs_to_its_end(tmp_path):
    run(tmp_path, ["ok", "ok", "ok"])
    assert [json.loads((tmp_path / f"result-{r}.json").read_text())["rank"] for r in range(3)] == [0, 1, 2]


def test_a_failed_rank_stops_the_others_and_shows_its_log(tmp_path):
    with pytest.raises(SystemExit) as err:
        run(tmp_path, ["hang", "fail"])
    text = str(err.value)
    assert "probe: ranks [0, 1] failed (rc [-9, 3])" in text, text
    assert "the log of rank 1 ends:\nrank 1: failing on purpose" in text, text  # not the killed rank's
    assert not alive(tmp_path, 0) and not alive(tmp_path, 1)


def test_the_deadline_kills_what_is_left(tmp_path):
    with pytest.raises(SystemExit) as err:
        run(tmp_path, ["ok", "hang"], timeout=3.0)
    assert "probe: ranks [1] failed (killed at the deadline, 3 s)" in str(err.value), str(err.value)
    assert not alive(tmp_path, 1)
    assert (tmp_path / "result-0.json").exists()


def test_the_processes_a_rank_started_are_killed_with_it(tmp_path):
    with pytest.raises(SystemExit):
        run(tmp_path, ["child"], timeout=3.0)  # killed at the deadline, its child started long before
    pid = int((tmp_path / "child-0").read_text())
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    if state not in ("gone", "Z"):  # left running: clean it up, then fail
        os.kill(pid, signal.SIGKILL)
    assert state in ("gone", "Z"), f"the rank's child {pid} outlived it (state {state})"
