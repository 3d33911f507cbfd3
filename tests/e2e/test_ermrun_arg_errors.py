"""ermrun's one-line errors (exit 2) for a malformed --nnodes or --nproc-per-node, naming the flag typed:
torch's parser raised a RuntimeError (a traceback) for --nnodes 1:2:3, and --nproc-per-node 0 was reported
as "--rdzv-conf nproc=0", a flag the user did not give. In-process: nothing is started."""

from __future__ import annotations

import faulthandler
import logging
import signal

import pytest

from launcher import ermrun


@pytest.fixture
def root_logging():
    """ermrun.run() sets the root logger up for its output: put pytest's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    faulthandler.unregister(signal.SIGUSR1)  # ermrun's `kill -USR1` stack dump
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nnodes", "1:2:3"], "--nnodes must be N or MIN:MAX (e.g. 2 or 1:4), got '1:2:3'"),
        (["--rdzv-backend", "static", "--nnodes", "1:2:3"], "--nnodes must be N or MIN:MAX"),
        (["--nnodes", "two"], "--nnodes must be N or MIN:MAX (e.g. 2 or 1:4), got 'two'"),
        (["--rdzv-backend", "static", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
    ],
)
def test_malformed_counts_are_one_line_errors_naming_the_flag(args, message, tmp_path, capfd, root_logging):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(7)\n")
    assert ermrun.run([*args, "--spares", "off", str(script)]) == 2
    err = capfd.readouterr().err
    assert f"ermrun: error: {message}" in err and "Traceback" not in err
