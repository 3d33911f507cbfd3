"""`erm stop` on what it reads from etcd that no agent wrote: a node record whose pid is no process id, a
malformed node or closed key. A real etcd and the real `erm` command; the agents are stood in for by the
test, which writes and deletes their keys and, for `--node`, gives a sleeping process as the agent."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.records import ClosedRecord, NodeRecord, RecordError, dumps
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


@pytest.fixture
def agent() -> Iterator[subprocess.Popen]:
    """A process standing in for a node's agent, in a process group of its own."""
    p = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield p
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(10)


def _act_as_agent(client: EtcdClient, closed_key: str, node_key: str) -> None:
    """What an agent does once the run's closed key holds a close: leave the run (its key goes)."""
    deadline = time.monotonic() + 15
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


@pytest.mark.parametrize(  # an erm stop each (~3 s): CI keeps the group; the record's checks are above
    "pid",
    ["group", pytest.param("zero", marks=pytest.mark.slow), pytest.param("bool", marks=pytest.mark.slow)],
)
def test_erm_stop_node_signals_nothing_for_a_pid_that_is_no_process_id(etcd, run_id, agent, pid):
    value = {"zero": 0, "group": -agent.pid, "bool": True}[pid]  # never -1: that would signal every process
    key = f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(key, _record("a", value))
    rc, out, err = _done(_erm(run_id, "--endpoint", etcd.endpoint, "--node", "a", "--wait", "0"))
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and "sent SIGTERM" not in out, out + err
    assert f"malformed value in etcd key {key}" in err and "'pid'" in err and "delete or fix" in err, err
    assert agent.poll() is None  # the agent's process group got no signal


def test_erm_stop_node_on_a_malformed_node_record_says_so(etcd, run_id):
    key = f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(key, b"garbage")
    rc, out, err = _done(_erm(run_id, "--endpoint", etcd.endpoint, "--node", "a"))
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    assert err.startswith(f"erm stop: error: malformed value in etcd key {key}: not JSON"), err
    assert "delete or fix the key" in err, err


def test_erm_stop_node_wait_0_says_it_asked_the_node_to_leave(etcd, run_id, agent):
    with EtcdClient(etcd.endpoint) as c:
        c.put(f"/elastic-rm/{run_id}/nodes/a", _record("a", agent.pid))
    rc, out, err = _done(_erm(run_id, "--endpoint", etcd.endpoint, "--node", "a", "--wait", "0"))
    assert rc == 0, (rc, out, err)
    assert agent.wait(10) == -signal.SIGTERM
    assert f"sent SIGTERM to node a's agent (pid {agent.pid})" in out, out
    assert "asked node a to leave" in out and "left run" not in out, out


def test_erm_stop_replaces_a_malformed_closed_key_and_waits(etcd, run_id):
    closed, node = f"/elastic-rm/{run_id}/closed", f"/elastic-rm/{run_id}/nodes/a"
    with EtcdClient(etcd.endpoint) as c:
        c.put(node, _record("a", 1))
        c.put(closed, b"garbage")
        p = _erm(run_id, "--endpoint", etcd.endpoint, "--wait", "30")
        try:
            _act_as_agent(c, closed, node)
        finally:
            rc, out, err = _done(p)
        assert ClosedRecord.parse(closed, c.get(closed).value).by == "erm stop"
    assert rc == 0, (rc, out, err)
    assert f"replacing the malformed value of {closed}" in out and "already closed" not in out, out
    assert "stopped: 1 node(s) left (a)" in out, out


def test_erm_stop_does_not_wait_for_a_malformed_node_key(etcd, run_id):
    node, bad = f"/elastic-rm/{run_id}/nodes/a", f"/elastic-rm/{run_id}/nodes/zz"
    with EtcdClient(etcd.endpoint) as c:
        c.put(node, _record("a", 1))
        c.put(bad, b"garbage")
        p = _erm(run_id, "--endpoint", etcd.endpoint, "--wait", "5")
        try:
            _act_as_agent(c, f"/elastic-rm/{run_id}/closed", node)
        finally:
            rc, out, err = _done(p)
    assert rc == 0, (rc, out, err)
    assert "stopped: 1 node(s) left (a)" in out and "still running" not in err, out + err
    assert err.count(bad) == 1 and "malformed" in err and "delete or fix" in err, err
