"""ermrun nodes as real processes on loopback, against a real etcd: rounds, failures, standby, failover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from elastic_rm.checkpoint.node_memory import memory_root
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from tests.conftest import Proc
from tests.e2e.helpers import STEPS, ermrun, records, steps_at_world, wait_until
from tests.ermrun_argv import TORCHRUN, flags, node_args


def test_two_nodes_run_to_completion_with_torchrun_environment(etcd, run_id, tmp_path, procs):
    nodes = [
        ermrun(tmp_path, f"n{i}", node_args(etcd.endpoint, run_id, "2", f"n{i}", nproc=2), steps_max=20)
        for i in range(2)
    ]
    procs.extend(nodes)
    for p in nodes:
        assert p.wait(120) == 0, p.output()[-3000:]
    starts = [r for n in ("n0", "n1") for r in records(tmp_path, n) if r.get("start")]
    assert sorted(r["rank"] for r in starts) == [0, 1, 2, 3]
    assert {r["world"] for r in starts} == {4}
    envs = [r["env"] for r in starts]
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "0", "1", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["TORCHELASTIC_RUN_ID"] for e in envs} == {
        run_id
    }
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1

    # the same script under stock torchrun (c10d) sees the same set of variables
    ref = tmp_path / "ref"
    ref.mkdir()
    # --log-dir: torchrun leaves its default one (torchelastic_*) in /tmp
    argv = [TORCHRUN, *flags(log_dir=ref / "logs", standalone=True, nproc_per_node=2), STEPS]
    env = {**os.environ, "STEPS_DIR": str(ref), "STEPS_NODE": "ref", "STEPS_MAX": "5"}
    assert subprocess.run(argv, env=env, capture_output=True, timeout=120).returncode == 0
    ref_names = {tuple(r["names"]) for r in records(ref, "ref") if r.get("start")}
    ours = {tuple(n for n in r["names"] if not n.startswith("ELASTIC_RM")) for r in starts}
    assert ours == ref_names


def three_nodes_training(etcd, run_id: str, tmp_path, procs) -> dict[str, Proc]:
    """Nodes a, b and c of a run of 2 to 3 nodes, each past its fifth step at world 3."""
    nodes = {n: ermrun(tmp_path, n, node_args(etcd.endpoint, run_id, "2:3", n)) for n in ("a", "b", "c")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 3) > 5 for n in nodes),
        120,
        "3 nodes training",
        nodes.values(),
    )
    return nodes


# 23 s; CI keeps tests/netns/test_partitions.py's leader lost past its lease (a new leader, back to 3)
@pytest.mark.slow
def test_sigkill_of_the_leader_node_gives_survivors_a_new_round_and_a_joiner_restores_three(
    etcd, run_id, tmp_path, procs
):
    nodes = three_nodes_training(etcd, run_id, tmp_path, procs)
    with EtcdClient(etcd.endpoint) as c:
        leader = c.get(f"/elastic-rm/{run_id}/leader").value.decode()
        assert leader in nodes
        nodes[leader].signal(signal.SIGKILL)  # the node that decides rounds: another must take over
        killed = time.time()
        survivors = [n for n in nodes if n != leader]
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 2, since=killed) > 3 for n in survivors),
            60,
            "survivors training at world 2",
            nodes.values(),
        )
        assert c.get(f"/elastic-rm/{run_id}/leader").value.decode() in survivors
    d = ermrun(tmp_path, "d", node_args(etcd.endpoint, run_id, "2:3", "d"))
    procs.append(d)
    joined = time.time()
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 3, since=joined) > 3 for n in [*survivors, "d"]),
        90,
        "back to world 3 with the new node",
        [*(nodes[n] for n in survivors), d],
    )


# 15 s; CI keeps tests/rendezvous/test_handler.py's standby promotion on real handlers and etcd
@pytest.mark.slow
def test_node_beyond_max_is_standby_then_promoted(etcd, run_id, tmp_path, procs):
    nodes = {n: ermrun(tmp_path, n, node_args(etcd.endpoint, run_id, "2", n)) for n in ("a", "b")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in nodes),
        120,
        "2 nodes training",
        nodes.values(),
    )
    spare = ermrun(tmp_path, "s", node_args(etcd.endpoint, run_id, "2", "s"))
    procs.append(spare)
    with EtcdClient(etcd.endpoint) as c:  # registered: from now on it waits as the standby
        key = Keyspace("/elastic-rm", run_id).node("s")
        wait_until(lambda: c.get(key) is not None, 120, "the third node to register", [spare])
    assert records(tmp_path, "s") == []  # waits as standby, runs no worker
    nodes["a"].signal(signal.SIGKILL)
    killed = time.time()
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 2, since=killed) > 3 for n in ("b", "s")),
        60,
        "standby promoted",
        [nodes["b"], spare],
    )


@pytest.mark.slow  # 10 s; CI keeps tests/netns/test_etcd_partition.py (the raft leader member cut off)
def test_job_survives_the_loss_of_one_etcd_member(run_id, tmp_path, procs):
    with EtcdCluster(size=3) as cluster:
        endpoints = ",".join(cluster.endpoints)
        nodes = {n: ermrun(tmp_path, n, node_args(endpoints, run_id, "2", n)) for n in ("a", "b")}
        procs.extend(nodes.values())
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in nodes), 120, "training", nodes.values()
        )
        cluster.kill(0)
        nodes["b"].signal(signal.SIGKILL)  # a round must now be decided through the remaining members
        killed = time.time()
        c = ermrun(tmp_path, "c", node_args(endpoints, run_id, "2", "c"))
        procs.append(c)
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 2, since=killed) > 3 for n in ("a", "c")),
            90,
            "a new round through the surviving etcd members",
            [nodes["a"], c],
        )
        for p in procs:
            p.stop()


@pytest.mark.slow
def test_sigstop_of_a_node_is_detected_within_the_lease(etcd, run_id, tmp_path, procs):
    """The lease bound as an order of etcd's own events: the frozen node's key ends with its lease (a
    lease of 2 s that nothing refreshed), no round leaves it out before that, and the leader's very next
    round write after it does."""
    nodes = three_nodes_training(etcd, run_id, tmp_path, procs)
    ks = Keyspace("/elastic-rm", run_id)
    history: list = []
    with EtcdClient(etcd.endpoint) as client:
        record = client.get(ks.node("c"))
        assert record is not None and record.lease
        granted = client.run(lambda c: c.get_lease_info(record.lease, keys=False))
        assert granted.grantedTTL == 2  # lease_ttl=2 in tests.ermrun_argv.CONF
        cancel = client.watch_prefix(ks.run, client.ping() + 1, history.extend)
        nodes["c"].signal(signal.SIGSTOP)
        stopped = time.time()
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 2, since=stopped) > 3 for n in ("a", "b")),
            60,
            "survivors training at world 2 after SIGSTOP",
            nodes.values(),
        )
        cancel()
    events = list(history)
    ended = [e.kv.mod_revision for e in events if e.kv.key == ks.node("c") and e.kind == "delete"]
    assert len(ended) == 1, "the frozen node's key must end with its lease, once"
    assert not [e for e in events if e.kv.key == ks.node("c") and e.kind == "put"]  # nothing kept it alive
    rounds = [
        (e.kv.mod_revision, RoundRecord.parse(e.kv.key, e.kv.value)) for e in events if e.kv.key == ks.round
    ]
    before = [r for rev, r in rounds if rev < ended[0]]
    after = [r for rev, r in rounds if rev > ended[0]]
    assert all("c" in r.members for r in before), "no round may leave the node out before its lease ended"
    assert after and "c" not in after[0].members and set(after[0].members) == {"a", "b"}, after[:1]


def test_stock_torchrun_uses_the_elastic_rm_backend(etcd, run_id, tmp_path, procs):
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": "t", "STEPS_MAX": "5"}
    torchrun_flags = flags(
        nnodes=1,
        nproc_per_node=2,
        rdzv_backend="elastic-rm",
        rdzv_endpoint=etcd.endpoint,
        rdzv_id=run_id,
        log_dir=tmp_path / "logs",
    )
    argv = [TORCHRUN, *torchrun_flags, STEPS]
    p = Proc(argv, str(tmp_path / "torchrun.log"), env=env)
    procs.append(p)
    assert p.wait(120) == 0, p.output()[-3000:]
    assert {r["world"] for r in records(tmp_path, "t") if r.get("start")} == {2}


# 15 s; CI keeps tests/netns/test_partitions.py's host cut off past its lease (its lease expires, it rejoins
# under a new id)
@pytest.mark.slow
def test_node_paused_past_its_lease_rejoins_as_a_new_member(etcd, run_id, tmp_path, procs):
    nodes = three_nodes_training(etcd, run_id, tmp_path, procs)
    shard = memory_root() / run_id / "c" / "step-5" / "shard"  # what a flash checkpoint leaves under c
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"0" * 4096)
    nodes["c"].signal(signal.SIGSTOP)  # agent and workers frozen: its lease (2 s) expires
    stopped = time.time()
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 2, since=stopped) > 3 for n in ("a", "b")),
        60,
        "survivors at world 2",
        nodes.values(),
    )
    nodes["c"].signal(signal.SIGCONT)
    resumed = time.time()
    with EtcdClient(etcd.endpoint) as client:
        wait_until(
            lambda: client.get(f"/elastic-rm/{run_id}/nodes/c-r1") is not None,
            60,
            "the resumed node registered under a new incarnation",
            nodes.values(),
        )
        assert client.get(f"/elastic-rm/{run_id}/nodes/c") is None  # the stale identity is gone for good
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 3, since=resumed) > 3 for n in ("a", "b")),
            90,
            "back to world 3 with the resumed node",
            nodes.values(),
        )
        members = json.loads(client.get(f"/elastic-rm/{run_id}/round").value)["members"]
        assert "c-r1" in members and "c" not in members
    (tmp_path / "stop").touch()  # the job ends: node c frees the memory of both its ids
    assert nodes["c"].wait(120) == 0, nodes["c"].output()[-3000:]
    assert not (memory_root() / run_id / "c").exists()
    out = nodes["c"].output()
    assert "node c-r1: node memory freed (succeeded; of c" in out and "node c-r1: job succeeded" in out, out
