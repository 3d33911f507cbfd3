"""`erm stop` on what it reads from etcd that no agent wrote: a node record whose pid is no process id, a
malformed node or closed key. A real etcd and `erm`'s main() in this process (a process of its own would
spend ~3 s importing torch; tests/e2e/test_erm_stop.py runs the real command against real agents); the
agents are stood in for by the test, which writes and deletes their keys and, for `--node`, gives a
sleeping process in a process group of its own as the agent."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.records import ClosedRecord, NodeRecord, RecordError, dumps
from launcher.erm import main as erm_main
from tests.conftest import BIN

ERM = os.path.join(BIN, "erm")


def _record(node: str, pid) -> bytes:
    """Node ``node``'s record as an agent on this host writes it, with ``pid`` as its agent's pid."""
    rec = NodeRecord(node=node, host=socket.gethostname(), addr="127.0.0.1", pid=1, nproc=1, state="active")
    body = json.loads(dumps(rec))
    body["pid"] = pid
    return json.dumps(body).encode()


def _erm(*args: str) -> subprocess.Popen:
    # a session of its own: should it signal its own process group (pid 0), that is not the test's
    return subprocess.Popen(
        [ERM, "stop", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _done(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


def _erm_stop(capsys, *args: str) -> tuple[int, str, str]:
    """`erm stop ARGS` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    rc = erm_main(["stop", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _erm_stop_beside(capsys, act: Callable[[], None], *args: str) -> tuple[int, str, str]:
    """`erm stop ARGS` while ``act`` runs on a thread of its own (the agents' part); ``act``'s failure is
    raised once erm stop returned."""
    failed: list[Exception] = []

    def guarded() -> None:
        try:
            act()
        except Exception as exc:  # raised again below, on the test's thread
            failed.append(exc)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    try:
        return _erm_stop(capsys, *args)
    finally:
        thread.join(30)
        assert not thread.is_alive(), "the stand-in agent still runs"
        if failed:
            raise failed[0]


@pytest.fixture
def agent() -> Iterator[subprocess.Popen]:
    """A process standing in for a node's agent, in a process group of its own."""
    p = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield p
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(10)


def _act_as_agent(endpoint: str, closed_key: str, node_key: str) -> None:
    """What an agent does once the run's closed key holds a close: leave the run (its key goes)."""
    deadline = time.monotonic() + 15
    with EtcdClient(endpoint) as client:
        while time.monotonic() < deadline:
            kv = client.get(closed_key)
            if kv is not None:
                try:
                    ClosedRecord.parse(kv.key, kv.value)
                except RecordError:
                    pass
                else:
                    client.delete(node_key)
                    return
            time.sleep(0.1)
        raise AssertionError(f"{closed_key} never held a close: {client.get(closed_key)}")


@pytest.mark.parametrize("pid", [0, -1, -4321])
def test_a_node_record_whose_pid_is_no_process_id_is_malformed(pid):
    with pytest.raises(RecordError, match=r"etcd key /x/nodes/a: .*'pid'"):
        NodeRecord.parse("/x/nodes/a", _record("a", pid))
    assert NodeRecord.parse("/x/nodes/a", _record("a", 7)).pid == 7


# an erm process each (~3 s) for zero and bool: CI keeps the group, in this process; the record's checks
# are above. zero runs erm in a session of its own: a pid 0 that got through would signal erm's own group
@pytest.mark.parametrize(
    "pid",
    ["group", pytest.param("zero", marks=pytest.mark.slow), pytest.param("bool", marks=pytest.mark.slow)],
)
def test_erm_stop_node_signals_nothing_for_a_pid_that_is_no_process_id(etcd, run_id, agent, capsys, pid):
    value = {"zero": 0, "group": -agent.pid, "bool": True}[pid]  # never -1: that would signal every process
    key = f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(key, _record("a", value))
    argv = (run_id, "--endpoint", etcd.endpoint, "--node", "a", "--wait", "0")
    rc, out, err = _erm_stop(capsys, *argv) if pid == "group" else _done(_erm(*argv))
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and "sent SIGTERM" not in out, out + err
    assert f"malformed value in etcd key {key}" in err and "'pid'" in err and "delete or fix" in err, err
    assert agent.poll() is None  # the agent's process group got no signal


def test_erm_stop_node_on_a_malformed_node_record_says_so(etcd, run_id, capsys):
    key = f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(key, b"garbage")
    rc, out, err = _erm_stop(capsys, run_id, "--endpoint", etcd.endpoint, "--node", "a")
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    assert err.startswith(f"erm stop: error: malformed value in etcd key {key}: not JSON"), err
    assert "delete or fix the key" in err, err


def test_erm_stop_node_wait_0_says_it_asked_the_node_to_leave(etcd, run_id, agent, capsys):
    with EtcdClient(etcd.endpoint) as c:
        c.put(f"/elastic-rm/{run_id}/nodes/a", _record("a", agent.pid))
    rc, out, err = _erm_stop(capsys, run_id, "--endpoint", etcd.endpoint, "--node", "a", "--wait", "0")
    assert rc == 0, (rc, out, err)
    assert agent.wait(10) == -signal.SIGTERM
    assert f"sent SIGTERM to node a's agent (pid {agent.pid})" in out, out
    assert "asked node a to leave" in out and "left run" not in out, out


def test_erm_stop_replaces_a_malformed_closed_key_and_waits(etcd, run_id, capsys):
    closed, node = f"/elastic-rm/{run_id}/closed", f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(node, _record("a", 1))
        c.put(closed, b"garbage")
        leave = functools.partial(_act_as_agent, etcd.endpoint, closed, node)
        rc, out, err = _erm_stop_beside(capsys, leave, run_id, "--endpoint", etcd.endpoint, "--wait", "30")
        assert ClosedRecord.parse(closed, c.get(closed).value).by == "erm stop"
    assert rc == 0, (rc, out, err)
    assert f"replacing the malformed value of {closed}" in out and "already closed" not in out, out
    assert "stopped: 1 node(s) left (a)" in out, out


def test_erm_stop_does_not_wait_for_a_malformed_node_key(etcd, run_id, capsys):
    node, bad = f"/elastic-rm/{run_id}/nodes/a", f"/elastic-rm/{run_id}/nodes/zz"
    with EtcdClient(etcd.endpoint) as c:
        c.put(node, _record("a", 1))
        c.put(bad, b"garbage")
    leave = functools.partial(_act_as_agent, etcd.endpoint, f"/elastic-rm/{run_id}/closed", node)
    rc, out, err = _erm_stop_beside(capsys, leave, run_id, "--endpoint", etcd.endpoint, "--wait", "5")
    assert rc == 0, (rc, out, err)
    assert "stopped: 1 node(s) left (a)" in out and "still running" not in err, out + err
    assert err.count(bad) == 1 and "malformed" in err and "delete or fix" in err, err
