"""When the run closes, `erm launch --slurm` stops at once only the node jobs that never joined it; a node
that was in one of the run's rounds keeps --exit-grace, even when no poll saw it registered."""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import ClosedRecord, DemandRecord, RoundRecord, dumps
from tests.slurm.helpers import actions, launch_events, sleeper_executor


def test_a_node_in_a_round_that_no_poll_saw_registered_is_not_stopped_as_never_joined(
    slurm, etcd, run_id, tmp_path
):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=2)
        client.put(keys.demand, DemandRecord(2, "test").to_json())
        assert executor.tick() is None
        deadline = time.monotonic() + 30
        while not all(n.slurm_node for n in executor.nodes.values()):  # both node jobs running
            assert time.monotonic() < deadline, [vars(n) for n in executor.nodes.values()]
            time.sleep(0.2)
            executor.tick()
        joined, never = sorted(executor.nodes.values(), key=lambda n: int(n.job_id))
        # the node joined, trained and left between two polls (its agent never seen in the nodes key)
        client.put(keys.record(1), RoundRecord(1, (joined.node_id,), reason="test").to_json())
        client.put(keys.closed, dumps(ClosedRecord(by=joined.node_id, time=time.time())))
        assert executor.tick() is None  # closing: waits --exit-grace for the node that joined
        assert joined.job_id in executor.nodes and not joined.stopping
        assert never.stopping
        executor._events.flush()
    stops = actions(launch_events(etcd, run_id), "stop")
    assert [s["job"] for s in stops] == [never.job_id] and "never joined" in stops[0]["reason"]
