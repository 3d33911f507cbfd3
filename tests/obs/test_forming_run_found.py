"""`erm status`/`top`/`events` without --run-id find the only run also while it forms its first round (its
nodes registered and a leader elected, no round key yet), and the history of jobs is not a run."""

from __future__ import annotations

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.planner.interface import NodeState
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import NodeRecord, dumps
from launcher.erm import main as erm_main


def test_status_without_run_id_finds_a_run_that_has_no_round_yet(etcd, run_id, capsys):
    prefix = f"/erm-forming-{run_id}"
    keys = Keyspace(prefix, run_id)
    node = NodeRecord(node="a", host="h", addr="127.0.0.1", pid=1, nproc=1, state=NodeState.JOINING)
    with EtcdClient(etcd.endpoint) as client:
        client.put(keys.node("a"), dumps(node))
        client.put(keys.leader, b"a")
        client.put(f"{prefix}/history/sig1/older-run", b"{}")  # a job's history: no run of its own
        try:
            rc = erm_main(["status", "--endpoint", etcd.endpoint, "--prefix", prefix, "--json"])
            out, err = capsys.readouterr()
            assert rc == 0, err  # was: "pass --run-id (runs under ...: none)", exit 2
            assert f'"run": "{run_id}"' in out
        finally:
            client.delete(prefix + "/", prefix=True)


def test_a_forming_run_shows_no_round_as_a_dash_not_none(etcd, run_id, capsys):
    prefix = f"/erm-forming-{run_id}"
    keys = Keyspace(prefix, run_id)
    with EtcdClient(etcd.endpoint) as client:
        client.put(keys.node("a"), b"{half a record")  # malformed: listed, not fatal
        try:
            rc = erm_main(["status", "--endpoint", etcd.endpoint, "--prefix", prefix, "--run-id", run_id])
            out, err = capsys.readouterr()
            assert rc == 0, err
            assert f"run {run_id}: round - (forming)" in out and "leader -," in out and "None" not in out
            assert "malformed" in out
        finally:
            client.delete(prefix + "/", prefix=True)
