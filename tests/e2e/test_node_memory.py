"""Node memory (/dev/shm/elastic-rm/<run>/<node>) is freed when a run ends in a way the agent sees, and
`erm gc` removes what a killed run left, never what a live run uses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_rm.checkpoint.node_memory import memory_root
from elastic_rm.checkpoint.owners import OWNERS, live_owners
from tests.conftest import BIN, Proc
from tests.e2e.helpers import wait_until

ERMRUN = os.path.join(BIN, "ermrun")
ERM = os.path.join(BIN, "erm")

# a worker that fills its node's memory directory (a flash checkpoint's layout: `erm gc` removes nothing
# else), then exits with the code given
WRITER = """
import os, pathlib, sys, time
env = os.environ
node = pathlib.Path(env["ELASTIC_RM_MEMORY_ROOT"]) / env["TORCHELASTIC_RUN_ID"] / env["ERM_NODE_ID"]
(node / "step-00000001").mkdir(parents=True, exist_ok=True)
(node / "step-00000001" / "shard").write_bytes(b"0" * 100_000)
(node / "step-00000001" / "manifest.json").write_text("{}")
if sys.argv[1] == "forever":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


def _writer(tmp_path: Path) -> str:
    path = tmp_path / "writer.py"
    path.write_text(WRITER)
    return str(path)


def _erm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ERM, *args], capture_output=True, text=True, timeout=60)


# 0: 5 s; CI keeps 3 (the same freeing) and erm stop's run of a plain script (test_erm_stop.py)
@pytest.mark.parametrize("code", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_node_memory_is_freed_when_the_job_succeeds_or_fails(tmp_path, run_id, code):
    argv = [ERMRUN, "--standalone", "--rdzv-id", run_id, "--max-restarts", "0", "--nproc-per-node", "1"]
    result = subprocess.run(
        [*argv, _writer(tmp_path), str(code)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == (0 if code == 0 else 1), result.stderr[-3000:]
    assert not (memory_root() / run_id).exists(), sorted((memory_root() / run_id).rglob("*"))
    assert "node memory freed" in result.stderr


def test_erm_gc_removes_a_killed_runs_memory_and_keeps_a_live_ones(tmp_path, procs):
    writer = _writer(tmp_path)
    live = Proc(
        [ERMRUN, "--standalone", "--rdzv-id", "live-run", "--nproc-per-node", "1", writer, "forever"],
        str(tmp_path / "live.log"),
    )
    dead = Proc(
        [ERMRUN, "--standalone", "--rdzv-id", "dead-run", "--nproc-per-node", "1", writer, "forever"],
        str(tmp_path / "dead.log"),
    )
    procs += [live, dead]
    for name, p in (("live-run", live), ("dead-run", dead)):
        wait_until(
            lambda n=name: any((memory_root() / n).glob("*/step-00000001")), 90, f"{name}'s node memory", [p]
        )
    assert live_owners(memory_root() / "live-run") == [live.pid]
    os.kill(dead.pid, signal.SIGKILL)  # the agent only: its watchdog ends the workers
    dead.wait(10)
    wait_until(lambda: not live_owners(memory_root() / "dead-run"), 15, "the killed agent's claim to go")
    assert (memory_root() / "dead-run").exists()  # a SIGKILL leaves the node's memory (a restart may use it)

    dry = _erm("gc", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {memory_root() / 'dead-run'}" in dry.stdout, dry.stdout
    assert f"kept {memory_root() / 'live-run'}" in dry.stdout and f"pid {live.pid}" in dry.stdout
    assert (memory_root() / "dead-run").exists()  # a dry run removes nothing

    done = _erm("gc")
    assert done.returncode == 0, done.stderr
    assert f"removed {memory_root() / 'dead-run'}" in done.stdout, done.stdout
    assert not (memory_root() / "dead-run").exists()
    assert any((memory_root() / "live-run").glob("*/step-00000001"))
    live.signal(signal.SIGTERM)
    live.wait(60)
    assert not (memory_root() / "live-run" / OWNERS).exists()  # the claim went with the agent
    assert any((memory_root() / "live-run").glob("*/step-00000001"))  # a signal leaves the node's memory
    assert "in use" not in _erm("gc").stdout and not (memory_root() / "live-run").exists()


def test_erm_gc_names_a_bad_root():
    result = _erm("gc", "--root", "/nonexistent/erm-gc")
    assert result.returncode == 2 and "--root /nonexistent/erm-gc is not a directory" in result.stderr


def test_a_claim_by_a_dead_process_is_not_live(tmp_path):
    from elastic_rm.checkpoint.owners import claim

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert claim(tmp_path / "run", child.pid) is not None
        assert live_owners(tmp_path / "run") == [child.pid]
    finally:
        child.kill()
        child.wait(10)
    deadline = time.monotonic() + 5
    while live_owners(tmp_path / "run") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_owners(tmp_path / "run") == []


def test_erm_gc_run_removes_that_runs_memory_only(tmp_path):
    root = tmp_path / "shm"
    for run in ("job-a", "job-b"):  # what killed runs left: no owner
        (root / run / "n0" / "step-00000005").mkdir(parents=True)
        (root / run / "n0" / "step-00000005" / "shard").write_bytes(b"0" * 4096)
        (root / run / "n0" / "step-00000005" / "manifest.json").write_text("{}")
    done = _erm("gc", "--root", str(root), "--run", "job-a")
    assert done.returncode == 0, done.stderr
    assert f"removed {root / 'job-a'}" in done.stdout and "job-b" not in done.stdout, done.stdout
    assert not (root / "job-a").exists() and (root / "job-b" / "n0" / "step-00000005" / "shard").exists()
    none = _erm("gc", "--root", str(root), "--run", "job-c")
    assert none.returncode == 0 and "no node memory of run 'job-c'" in none.stdout, none.stdout
