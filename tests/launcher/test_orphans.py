"""Nothing outlives its owner: an agent killed by SIGKILL takes its workers and its embedded etcd with it,
and its temporary directories go too."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from tests.conftest import BIN
from tests.launcher.helpers import STEPS, records


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


def test_a_sigkilled_agent_takes_its_workers_and_its_etcd_with_it(tmp_path):
    own_tmp = tmp_path / "tmp"  # the agent's temporary directories: its channel, etcd's data, torch's logs
    own_tmp.mkdir()
    env = {
        **os.environ,
        "STEPS_DIR": str(tmp_path),
        "STEPS_NODE": "o",
        "STEPS_MAX": "0",
        "TMPDIR": str(own_tmp),
    }
    agent = subprocess.Popen(
        [os.path.join(BIN, "ermrun"), "--standalone", "--nproc-per-node", "2", STEPS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    owned: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len([r for r in records(tmp_path, "o") if r.get("start")]) < 2 and time.monotonic() < deadline:
            assert agent.poll() is None, "ermrun ended before its workers started"
            time.sleep(0.2)
        children = psutil.Process(agent.pid).children(recursive=True)
        workers = [p.pid for p in children if "steps.py" in " ".join(p.cmdline())]
        etcd = [p.pid for p in children if p.name() == "etcd"]
        owned = workers + etcd
        assert len(workers) == 2 and len(etcd) == 1, [p.cmdline() for p in children]
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
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        for pid in owned:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
