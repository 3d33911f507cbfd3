"""Stock torchrun with the elastic-rm backend, a node that arrives after the run closed: it exits 0 with a
message saying why, not with torch 2.13's traceback (its launch_agent calls ``result.is_failed()`` on the
None that the agent returns after RendezvousGracefulExitError)."""

from __future__ import annotations

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import Keyspace
from tests.conftest import Proc
from tests.e2e.helpers import STEPS, records, steps_at_world, wait_until
from tests.ermrun_argv import TORCHRUN, flags


def torchrun(tmp_path, etcd, run_id: str, node: str, steps: int = 3) -> Proc:
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": node, "STEPS_MAX": str(steps)}
    torchrun_flags = flags(
        nnodes=1,
        nproc_per_node=1,
        rdzv_backend="elastic-rm",
        rdzv_endpoint=etcd.endpoint,
        rdzv_id=run_id,
        rdzv_conf="lease_ttl=2,join_timeout=60",
        log_dir=tmp_path / f"{node}-logs",
    )
    argv = [TORCHRUN, *torchrun_flags, STEPS]
    return Proc(argv, str(tmp_path / f"{node}.log"), env=env)


def test_a_node_arriving_after_the_run_closed_exits_0_with_a_message(etcd, run_id, tmp_path, procs):
    first = torchrun(tmp_path, etcd, run_id, "first")
    procs.append(first)
    assert first.wait(120) == 0, first.output()[-3000:]
    assert any(r.get("start") for r in records(tmp_path, "first"))

    late = torchrun(tmp_path, etcd, run_id, "late")
    procs.append(late)
    code = late.wait(120)
    out = late.output()
    assert code == 0, out[-3000:]
    assert "Traceback" not in out and "is_failed" not in out, out[-3000:]
    assert f"run {run_id} is closed" in out and "exiting with status 0" in out, out[-3000:]
    assert not records(tmp_path, "late")  # no worker was started


# 11 s; CI keeps the node arriving after the run closed, above (the same exit 0 and message)
@pytest.mark.slow
def test_a_standby_node_still_waiting_when_the_run_ends_exits_0_with_a_message(etcd, run_id, tmp_path, procs):
    """--nnodes 1: the second node waits as standby (torch's semantics: beyond MAX); the job then ends."""
    member = torchrun(tmp_path, etcd, run_id, "member", steps=0)  # until the stop file
    procs.append(member)
    wait_until(lambda: steps_at_world(tmp_path, "member", 1) > 3, 120, "the member training", [member])
    standby = torchrun(tmp_path, etcd, run_id, "standby")
    procs.append(standby)
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        wait_until(
            lambda: len(client.get_prefix(keys.nodes)[0]) == 2, 60, "the standby registered", [standby]
        )
    (tmp_path / "stop").touch()
    assert member.wait(120) == 0, member.output()[-3000:]
    code = standby.wait(60)
    out = standby.output()
    assert code == 0 and "Traceback" not in out, out[-3000:]
    assert f"run {run_id} is closed" in out and "exiting with status 0" in out, out[-3000:]
    assert not records(tmp_path, "standby")
