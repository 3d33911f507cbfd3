"""Flash checkpoints end to end under ermrun. Three agents train the example DLRM with replicated flash
checkpoints and no durable copy; one node is killed and its memory deleted; the survivors restore its
shards from the replica its ring peer received over HTTP (the only copy left). And the sample ledger that
the leader mirrors into etcd ends at the drain's final checkpoint after `erm stop`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from elastic_rm.checkpoint.node_memory import run_memory_dir
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import records, wait_until
from tests.ermrun_argv import ermrun_argv, flags, node_args

TRAIN = os.path.join(REPO, "examples", "dlrm", "train.py")


def node(tmp_path: Path, etcd, run_id: str, name: str) -> Proc:
    argv = ermrun_argv(
        *node_args(etcd.endpoint, run_id, "2:3", name, "lease_ttl=2,last_call_timeout=3,join_timeout=300"),
        TRAIN,
        *flags(progress_dir=tmp_path, checkpoint_every=5, tables=4, rows=4000, global_batch=60),
        monitor_interval=0.1,
        max_restarts=3,
    )
    return Proc(argv, str(tmp_path / f"{name}.agent.log"), env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_lost_node_restored_from_replica_over_http(etcd, run_id, tmp_path: Path, procs) -> None:
    memory = run_memory_dir(run_id)
    try:
        nodes = {n: node(tmp_path, etcd, run_id, n) for n in ("a", "b", "c")}
        procs.extend(nodes.values())
        # c's ring peer is a (sorted node ids): a's agent keeps c's replica, received over HTTP
        held = memory / "a" / "replicas" / "c"

        def replica_at_world3() -> bool:
            """The replica's steps are pruned while this polls: one gone before its read is skipped."""
            for p in held.glob("step-*") if held.is_dir() else []:
                try:
                    if json.loads((p / "manifest.json").read_text())["world_size"] == 3:
                        return True
                except FileNotFoundError:
                    continue
            return False

        wait_until(replica_at_world3, 300, "a world-3 replica of c's shards on a", list(nodes.values()))
        nodes["c"].signal(signal.SIGKILL)  # agent and worker: the node is lost
        nodes["c"].wait(30)
        shutil.rmtree(memory / "c")  # and with it its memory copy

        def restored_at_world2(name: str) -> list[dict]:
            return [r for r in records(tmp_path, name) if r.get("start") and r.get("world") == 2]

        wait_until(
            lambda: (
                all(restored_at_world2(n) for n in ("a", "b"))
                and all(
                    any(r.get("world") == 2 and "step" in r for r in records(tmp_path, n)) for n in ("a", "b")
                )
            ),
            240,
            "a and b training at world 2 after a restore",
            [nodes["a"], nodes["b"]],
        )
        starts = [restored_at_world2(n)[0] for n in ("a", "b")]
        # no durable copy exists: the restore could only take c's shards from the replica a holds
        assert all(s["restored_step"] is not None and s["restored_step"] >= 5 for s in starts), starts
        assert len({s["restored_step"] for s in starts}) == 1 and len({s["checksum"] for s in starts}) == 1
        assert not (memory / "c").exists()
        (tmp_path / "stop").write_text("")
        for n in ("a", "b"):
            assert nodes[n].wait(120) == 0, nodes[n].output()[-3000:]
    finally:
        shutil.rmtree(memory, ignore_errors=True)


@pytest.mark.slow
def test_the_ledger_in_etcd_ends_at_the_drained_step_after_erm_stop(
    etcd, run_id, tmp_path: Path, procs
) -> None:
    """`erm status`' data line reads the ledger the leader mirrors; after `erm stop` it is the one of the
    drain's final checkpoint, not of the periodic checkpoint before it."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.wire.keyspace import Keyspace

    argv = ermrun_argv(
        *node_args(etcd.endpoint, run_id, "1", "a", conf="lease_ttl=2"),
        TRAIN,
        *flags(progress_dir=tmp_path, checkpoint_every=50, tables=2, rows=1000, global_batch=60),
        monitor_interval=0.1,
    )
    a = Proc(argv, str(tmp_path / "a.agent.log"), env={"OMP_NUM_THREADS": "1"})
    procs.append(a)
    wait_until(lambda: sum("step" in r for r in records(tmp_path, "a")) >= 60, 300, "60 steps", [a])
    stop = subprocess.run(
        [os.path.join(BIN, "erm"), "stop", run_id, "--endpoint", etcd.endpoint],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert a.wait(120) == 0, a.output()[-3000:]
    (drained,) = [r["drained_step"] for r in records(tmp_path, "a") if "drained_step" in r]
    with EtcdClient(etcd.endpoint) as c:
        ledger = json.loads(c.get(Keyspace("/elastic-rm", run_id).ledger).value)
    assert ledger["step"] == drained, (ledger["step"], drained)
