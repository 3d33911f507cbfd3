"""An etcd server dies with the process that started it, however that process ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from elastic_rm.etcd.server import EtcdServer

OWNER = """
import json, sys, time
from elastic_rm.etcd.server import EtcdServer
server = EtcdServer().start()
print(json.dumps({"etcd": server.members[0].proc.pid, "guard": server._watchdog.pid}), flush=True)
time.sleep(120)
"""


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_owner_takes_its_etcd_with_it(how):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert psutil.Process(pids["etcd"]).name() == "etcd"
        owner.send_signal(how)
        owner.wait(10)
        assert gone_within(pids["etcd"], 10), "etcd outlived its owner"
        assert gone_within(pids["guard"], 10), "the watchdog outlived its work"
    finally:
        owner.kill()
        owner.wait(10)
        for key in ("etcd", "guard"):
            try:
                os.kill(pids[key], signal.SIGKILL)
            except (ProcessLookupError, NameError):
                pass


def test_a_stopped_server_leaves_no_watchdog_and_a_restarted_member_is_watched():
    server = EtcdServer().start()
    try:
        guard = server._watchdog.pid
        first = server.members[0].proc.pid
        server.restart(0)
        second = server.members[0].proc.pid
        assert first != second and psutil.pid_exists(guard)
    finally:
        server.stop()
    assert gone_within(guard, 5) and gone_within(second, 5)
