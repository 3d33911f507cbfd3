"""What ermrun prints and logs: a failure as one event line (and in the event log with ranks and exit
codes), nothing but warnings and errors with --quiet, a live status line on a terminal."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

from tests.e2e.helpers import STEPS
from tests.ermrun_argv import ERMRUN, ermrun_argv


@pytest.mark.slow  # 10 s; CI keeps the failure of a node alone below and tests/obs's event display
def test_a_failure_is_one_event_line_and_an_event_quiet_prints_none(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    log = tmp_path / "events.jsonl"
    result = subprocess.run(
        ermrun_argv(str(script), nproc_per_node=1, membership_grace=0, rdzv_id="fails", event_log=log),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("[ermrun] ")]
    assert any(" failure " in line and "exit code(s) [3]; no restarts left" in line for line in lines), lines
    events = [json.loads(line) for line in log.read_text().splitlines()]
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["data"]["ranks"] == [0] and failure["data"]["exit_codes"] == [3]
    assert (events[-1]["kind"], events[-1]["data"]["status"]) == ("job", "failed (rank(s) [0])")
    quiet = subprocess.run(
        [ERMRUN, "--quiet", "--nproc-per-node", "1", "--membership-grace", "0", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.returncode != 0 and "fail.py" in quiet.stderr  # torch's failure report still comes
    assert " failure " not in quiet.stderr and " decision " not in quiet.stderr


def test_a_failure_on_a_node_alone_waits_no_membership_grace(tmp_path):
    """No peer's loss can have failed the workers of a one-node world: the failure is final at once."""
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    result = subprocess.run(
        [ERMRUN, "--standalone", "--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if " failure " in line]
    assert any("no restarts left (membership grace 0s)" in line for line in lines), result.stderr[-2000:]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # torch's @record under capsys
def test_bad_event_log_path_is_a_clear_error(tmp_path, capsys):
    from launcher.ermrun import run

    assert run(["--event-log", str(tmp_path), STEPS]) == 2  # a directory: fails before anything starts
    assert f"--event-log {tmp_path}: cannot append" in capsys.readouterr().err


@pytest.mark.slow
def test_live_status_line_on_a_terminal(tmp_path):
    master, slave = os.openpty()
    env = {**os.environ, "STEPS_DIR": str(tmp_path), "STEPS_NODE": "t", "TERM": "xterm"}
    p = subprocess.Popen(
        [ERMRUN, "--nproc-per-node", "1", "--node-id", "tty", STEPS],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 120
        while b"round 1 rank 0/1 | healthy" not in seen:  # the agent's round and its workers' state
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        (tmp_path / "stop").touch()
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        os.close(master)
    text = seen.decode(errors="replace")
    assert "\r\x1b[2Kermrun tty | round 1 rank 0/1 | healthy" in text  # redrawn in place, not scrolled
    assert "decision round 1: 1 member(s)" in text
