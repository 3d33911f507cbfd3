"""The `erm` command ends its process without tearing the interpreter down (launcher.erm.console): what
a subcommand wrote must still arrive whole, through a pipe, and its exit status must be the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = os.path.dirname(sys.executable)
ERM = os.path.join(BIN, "erm")
REPO = Path(__file__).resolve().parents[2]


# buffered as a user's shell runs it (an environment may set PYTHONUNBUFFERED, which would hide a lost buffer)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def erm(*args: str, stdin: str | None = None, command=(ERM,)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command, *args], input=stdin, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120
    )


def test_the_erm_script_is_the_console_entry_point():
    assert "from launcher.erm import console" in Path(ERM).read_text()


def test_output_through_a_pipe_arrives_whole_and_status_zero():
    # stdout into a pipe is block-buffered: the whole plan sits in the buffer until the flush before the
    # process ends, so without it nothing would arrive
    done = erm("plan", "-", "--json", stdin=(REPO / "examples" / "dlrm" / "job.json").read_text())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["signature"].startswith("dlrm-example-")


def test_a_failing_subcommand_keeps_its_status_and_message(tmp_path):
    done = erm("plan", str(tmp_path / "missing.json"))
    assert done.returncode == 2
    assert f"erm plan: {tmp_path / 'missing.json'}: cannot read" in done.stderr


def test_python_dash_m_ends_the_same_way():
    done = erm("plan", "examples/dlrm/job.json", "--json", command=(sys.executable, "-m", "launcher.erm"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["signature"].startswith("dlrm-example-")
