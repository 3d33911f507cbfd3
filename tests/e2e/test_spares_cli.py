"""ermrun with spares: torchrun's --redirects/--tee/--log-dir work for workers started from spares, and
bad --spares/--spare-preload values are clear errors before anything starts."""

from __future__ import annotations

import glob

import pytest

from tests.e2e.helpers import ermrun_here
from tests.e2e.test_ermrun_cli import run

SCRIPT = """
import os, sys
print(f"out rank {os.environ['RANK']} pid {os.getpid()} torch {'torch' in sys.modules}", flush=True)
print(f"err rank {os.environ['RANK']}", file=sys.stderr, flush=True)
"""


def test_redirects_and_tee_reach_the_log_dir_and_the_console(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    args = ["--standalone", "--nproc-per-node", "2", "--redirects", "3", "--tee", "2", "--log-dir", str(logs)]
    result = run([*args, str(script)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 worker(s) started from warm spares" in result.stderr
    for rank in (0, 1):
        (out,) = glob.glob(str(logs / "*" / "attempt_0" / str(rank) / "stdout.log"))
        (err,) = glob.glob(str(logs / "*" / "attempt_0" / str(rank) / "stderr.log"))
        text = open(out).read()
        assert f"out rank {rank} pid" in text and "torch True" in text  # the spare had imported torch
        assert open(err).read() == f"err rank {rank}\n"
        assert f"err rank {rank}" in result.stderr  # --tee 2: stderr also on the console
        assert (
            f"out rank {rank}" not in result.stdout
        )  # --redirects 3 without --tee 1: stdout only in the file


@pytest.mark.parametrize(
    "args,message",
    [
        (["--spares", "maybe"], "argument --spares: invalid choice: 'maybe'"),
        (["--spare-preload", "no_such_module_erm"], "module 'no_such_module_erm' is not installed"),
        (["--spare-preload", "torch rec"], "'torch rec' is not a module name"),
        (["--malloc-arenas", "-1"], "--malloc-arenas must be >= 0"),
        (["--malloc-arenas", "one"], "argument --malloc-arenas: invalid int value: 'one'"),
    ],
)
def test_bad_spare_flags_are_clear_errors(capfd, args, message):
    """In this process (ermrun_here: no torch import of its own). That a real ermrun refused after its
    imports leaves no early spare is tests/agent/test_early_spares.py's."""
    assert ermrun_here([*args, "--standalone", "x.py"]) == 2
    err = capfd.readouterr().err
    assert "ermrun: error: " in err and message in err, err[-2000:]
    assert "Traceback" not in err


ARENAS_SCRIPT = """
import os
# the environment this process was started with is the one glibc's malloc read (a spare's os.environ is
# replaced by its round's): /proc/self/environ keeps it
started = dict(v.split("=", 1) for v in open("/proc/self/environ").read().split("\\0") if "=" in v)
arenas = os.environ.get("MALLOC_ARENA_MAX")
print(f"arenas env {arenas} started {started.get('MALLOC_ARENA_MAX')}", flush=True)
"""


@pytest.mark.parametrize(
    "args,user,expected",
    [
        ([], None, "1"),  # the default: one arena, from the spare's start on
        # workers torch starts inherit it too (a job each, ~4 s: make test-all)
        pytest.param(["--spares", "off"], None, "1", marks=pytest.mark.slow),
        pytest.param(["--malloc-arenas", "0"], None, "None", marks=pytest.mark.slow),  # glibc's default
        (["--malloc-arenas", "2"], "4", "4"),  # the user's own MALLOC_ARENA_MAX wins
    ],
)
def test_workers_start_with_the_malloc_arenas_asked_for(tmp_path, monkeypatch, args, user, expected):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)  # an agent built in this process set it
    if user is not None:
        monkeypatch.setenv("MALLOC_ARENA_MAX", user)
    script = tmp_path / "arenas.py"
    script.write_text(ARENAS_SCRIPT)
    result = run([*args, "--standalone", "--nproc-per-node", "1", str(script)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"arenas env {expected} started {expected}" in result.stdout, result.stdout[-2000:]
    if "--spares" not in args:
        assert "1 worker(s) started from warm spares" in result.stderr
