"""Nothing outlives its owner: an agent killed by SIGKILL takes its workers and its embedded etcd with it,
and its temporary directories go too."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import BIN
from tests.e2e.helpers import STEPS, records


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive (not zombies) after ``seconds``."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [
            p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        time.sleep(0.1)
    return alive


def _start(tmp_path, *flags: str, own_tmp=None) -> subprocess.Popen:
    env = {**os.environ, "STEPS_DIR": str(tmp_path), "STEPS_NODE": "o", "STEPS_MAX": "0"}
    if own_tmp is not None:  # the agent's temporary directories: its channel, etcd's data, torch's logs
        env["TMPDIR"] = str(own_tmp)
    with open(tmp_path / "ermrun.log", "wb") as log:  # read by the assertions, kept for a failed test
        return subprocess.Popen(
            [os.path.join(BIN, "ermrun"), "--standalone", "--nproc-per-node", "2", *flags, STEPS],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _log(tmp_path) -> str:
    return (tmp_path / "ermrun.log").read_text(errors="replace")[-4000:]


def _alive(procs: list[psutil.Process]) -> list[tuple[psutil.Process, str]]:
    """(process, command line) of those still there: a child may exit (a zombie) while we look."""
    out = []
    for p in procs:
        try:
            out.append((p, " ".join(p.cmdline())))
        except psutil.Error:
            pass
    return out


def _started_workers(
    agent: subprocess.Popen, tmp_path, spares: int
) -> tuple[list[int], list[int], list[int]]:
    """(workers, spares, etcd) pids once both workers trained and ``spares`` spares wait."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert agent.poll() is None, (
            f"ermrun ended ({agent.returncode}) before its workers started:\n{_log(tmp_path)}"
        )
        workers = [r["pid"] for r in records(tmp_path, "o") if r.get("start")]
        children = _alive(psutil.Process(agent.pid).children(recursive=True))
        waiting = [p.pid for p, cmd in children if "spare.py" in cmd and p.pid not in workers]
        etcd = [p.pid for p, _ in children if p.name() == "etcd"]
        if len(workers) == 2 and len(waiting) >= spares:
            return workers, waiting, etcd
        time.sleep(0.2)
    raise AssertionError(f"no 2 workers and {spares} spares within 120 s")


def test_a_sigkilled_agent_takes_its_workers_spares_and_etcd_with_it(tmp_path):
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    agent = _start(tmp_path, own_tmp=own_tmp)
    owned: list[int] = []
    try:
        workers, spares, etcd = _started_workers(agent, tmp_path, spares=2)
        owned = workers + spares + etcd
        children = [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
        assert set(workers) <= set(children) and len(spares) == 2 and len(etcd) == 1
        made = sorted(p.name.split("_")[0].rsplit("-", 1)[0] for p in own_tmp.iterdir())
        assert made == ["elastic-rm-agent", "erm-etcd", "torchelastic"], made
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert _gone_within(owned, 15) == [], "processes outlived their agent"
        deadline = time.monotonic() + 15  # the watchdogs remove them once their owners are gone
        while list(own_tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(own_tmp.iterdir()) == [], "temporary directories outlived their agent"
    finally:
        _stop(agent, owned)


@pytest.mark.slow  # 10 s; CI keeps a run with --spares off in tests/e2e/test_spares_cli.py
def test_spares_off_starts_no_spare_process(tmp_path):
    agent = _start(tmp_path, "--spares", "off")
    workers: list[int] = []
    try:
        workers, spares, _ = _started_workers(agent, tmp_path, spares=0)
        time.sleep(1)  # spares would start right after the workers
        children = _alive(psutil.Process(agent.pid).children(recursive=True))
        assert not [p for p, cmd in children if "spare.py" in cmd], "a spare exists"
        assert spares == []
        for pid in workers:  # plain `python -u steps.py`, as under torchrun
            assert psutil.Process(pid).cmdline()[-1] == STEPS
        (tmp_path / "stop").touch()
        assert agent.wait(60) == 0
    finally:
        _stop(agent, workers)


def _stop(agent: subprocess.Popen, owned: list[int]) -> None:
    if agent.poll() is None:
        agent.kill()
        agent.wait(10)
    for pid in owned:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
