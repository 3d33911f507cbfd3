"""ermrun's spares started before its own imports (launcher.early_spares): which flags start them, how the
agent's pool adopts those that fit and stops the rest by their pid, and that none is left when ermrun
ends before adopting them (an error, a SIGTERM during its imports). End to end: a node's first workers
come from the spare started first thing, none is started again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest

from elastic_rm.agent.spare_process import Spare
from elastic_rm.agent.spares import SparePool
from elastic_rm.guard import Watchdog
from launcher.early_spares import EarlySpares, plan, read_flags
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import STEPS, wait_until
from tests.slurm.helpers import gone


def test_the_flags_before_the_script_are_read_and_the_scripts_own_are_not():
    flags, script = read_flags(
        ["--nnodes", "1:4", "--nproc_per_node=2", "--standalone", "train.py", "--nproc-per-node", "8"]
    )
    assert flags == {"--nnodes": "1:4", "--nproc-per-node": "2", "--standalone": True}
    assert script == ["train.py", "--nproc-per-node", "8"]
    assert plan(["--nproc_per_node=2", "train.py", "--nproc-per-node", "8"], {}) == (
        2,
        ("torch",),
        ("train.py", "--nproc-per-node", "8"),
    )
    assert plan(["-m", "pkg.train", "--lr", "1"], {}) == (1, ("torch",), ("-m", "pkg.train", "--lr", "1"))
    assert plan(["--spare-preload", "torch, torchrec", "t.py"], {"PET_NPROC_PER_NODE": "3"}) == (
        3,
        ("torch", "torchrec"),
        ("t.py",),
    )


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--spares", "off", "t.py"], {}),
        (["--no_python", "t.sh"], {}),
        (["--run-path", "t.py"], {}),
        (["--numa-binding", "node", "t.py"], {}),
        (["--nproc-per-node", "auto", "t.py"], {}),
        (["--cpu-limit", "0.5", "t.py"], {}),
        (["--memory-limit=4G", "t.py"], {}),
        (["--help"], {}),
        (["--nnodes", "2"], {}),  # no script: ermrun's parser says so
        (["t.py"], {"PYTHON_EXEC": "/usr/bin/python3"}),
        (["t.py"], {"PET_NO_PYTHON": "1"}),
    ],
)
def test_no_early_spares_where_the_agent_would_not_start_them_so(argv, env):
    assert plan(argv, env) is None


def _spare(modules=("json",), label=("script.py",)) -> Spare:
    return Spare(modules, low_priority=False, label=label)


def test_the_pool_adopts_the_spares_that_fit_and_stops_the_rest_by_pid():
    guard = Watchdog()
    pool = SparePool(("json",), guard, label=("script.py",))
    fits, extra = _spare(), _spare()
    other_modules, other_label = _spare(modules=("csv",)), _spare(label=("other.py",))
    try:
        adopted = pool.adopt([fits, other_modules, other_label, extra], count=1)
        assert adopted == [fits.pid] and pool.pids() == [fits.pid]
        for stopped in (other_modules, other_label, extra):
            assert gone(stopped.pid)
        assert pool.take_adopted() == [fits.pid] and pool.take_adopted() == []  # a join waits once
        assert pool.fill(1, low_priority=False) == []  # the adopted spare is the node's one
    finally:
        pool.close()
        guard.release()
    assert gone(fits.pid)


def test_early_spares_not_handed_over_are_stopped_by_their_pid():
    before = signal.getsignal(signal.SIGTERM)
    early = EarlySpares.start(["--spare-preload", "json", "--nproc-per-node", "2", "script.py"])
    pids = early.pids()
    assert len(pids) == 2 and all(not gone(p) for p in pids)
    early.stop()
    assert all(gone(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) == before  # what it was before: ermrun's to set


EARLY_THEN_IMPORTS = """
import json, sys, time
from launcher.early_spares import EarlySpares
early = EarlySpares.start(["--spare-preload", "json", "script.py"])
print(json.dumps(early.pids()), flush=True)
time.sleep(120)  # ermrun's imports
"""


def test_a_sigterm_during_ermruns_imports_stops_the_early_spares_and_exits_0():
    p = subprocess.Popen(
        [sys.executable, "-c", EARLY_THEN_IMPORTS],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(p.stdout.readline())
        assert len(pids) == 1 and not gone(pids[0])
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0  # a node stopped before its workers started: no failure
        assert gone(pids[0])
        assert "stopped by SIGTERM during its start-up, before its workers started" in p.stderr.read()
    finally:
        p.kill()
        p.wait(10)


def _spares_labelled(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any("spare.py" in a for a in cmdline) and marker in cmdline:
            found.append(proc.pid)
    return found


def test_an_ermrun_that_fails_after_its_imports_leaves_no_early_spare(tmp_path):
    marker = f"marker-{uuid.uuid4().hex}"
    argv = [os.path.join(BIN, "ermrun"), "--standalone", "--max-restarts", "x", STEPS, marker]
    p = Proc(argv, str(tmp_path / "ermrun.log"))
    try:
        wait_until(lambda: _spares_labelled(marker), 60, "the early spare (ermrun still imports)", [p])
        assert p.wait(60) == 2, p.output()[-3000:]  # torch's parser refuses the flag, after the imports
        assert _spares_labelled(marker) == []
    finally:
        p.stop()


def test_a_nodes_first_workers_come_from_the_spare_started_before_ermruns_imports(tmp_path):
    events = tmp_path / "events.jsonl"
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": "n1", "STEPS_MAX": "3"}
    argv = [
        os.path.join(BIN, "ermrun"),
        "--standalone",
        "--nproc-per-node",
        "1",
        "--monitor-interval",
        "0.1",
        "--event-log",
        str(events),
        STEPS,
    ]
    p = Proc(argv, str(tmp_path / "ermrun.log"), env=env)
    try:
        assert p.wait(120) == 0, p.output()[-3000:]
    finally:
        p.stop()
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    started = next(r for r in rows if r["data"].get("status") == "started")
    warm = next(r for r in rows if "spares_warm" in r["data"])
    first_round = next(r for r in rows if "from_spares" in r["data"])
    assert warm["data"]["spares_warm"] and len(warm["data"]["early_pids"]) == 1
    assert first_round["data"]["new_processes"] == 0 and list(first_round["data"]["from_spares"]) == ["0"]
    assert (
        first_round["data"]["from_spares"]["0"] == warm["data"]["early_pids"][0]
    )  # ermrun's, not the agent's
    assert started["data"]["process_started"] <= started["time"]
