"""The first round waits for the node jobs the run's pool already runs (``running_nodes`` of the queue
record, written by `erm launch --slurm`), and a record whose writer is gone never holds it."""

from __future__ import annotations

import logging
import threading
import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace
from elastic_rm.wire.records import QueueRecord, RoundRecord

from .test_handler import join_all, make, wait_for

LEADER_LOG = "elastic_rm.rendezvous.leader"


def first_round(client: EtcdClient, keys: Keyspace) -> RoundRecord:
    kv = client.get(keys.record(1))
    assert kv is not None
    return RoundRecord.parse(keys.record(1), kv.value)


def test_the_first_round_waits_for_a_running_node_that_registers_late(etcd, run_id, caplog):
    caplog.set_level(logging.INFO, logger=LEADER_LOG)
    keys = Keyspace(DEFAULT_PREFIX, run_id)
    early, late = make(etcd, run_id, 1, 3), None
    results = {}
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        client.put(keys.queue, QueueRecord(0, "test", time=time.time(), running_nodes=2).to_json())
        first = threading.Thread(target=lambda: results.setdefault("early", early.next_rendezvous()))
        first.start()
        try:
            # the early node registered and leads; its round of one would form a last call later
            assert wait_for(
                lambda: any("round 1 waits for 1 more node" in r.getMessage() for r in caplog.records)
            )
            assert client.get(keys.record(1)) is None
            late = make(etcd, run_id, 1, 3)
            join_all([late])
            first.join(30)
            assert not first.is_alive()
            r1 = first_round(client, keys)
            assert len(r1.members) == 2
            assert {results["early"].world_size} == {2}
            assert any("all 2 running node job(s) registered" in r.getMessage() for r in caplog.records)
        finally:
            for h in (early, late):
                if h is not None:
                    h.shutdown()
            first.join(30)


def test_a_record_written_long_ago_holds_no_round(etcd, run_id, caplog):
    caplog.set_level(logging.INFO, logger=LEADER_LOG)
    keys = Keyspace(DEFAULT_PREFIX, run_id)
    node = make(etcd, run_id, 1, 3)
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        old = time.time() - 120  # its launcher died: nothing refreshed the record since
        client.put(keys.queue, QueueRecord(0, "test", time=old, running_nodes=3).to_json())
        try:
            info = join_all([node])[0]
            assert info.world_size == 1
            assert len(first_round(client, keys).members) == 1
            assert not any("round 1 waits" in r.getMessage() for r in caplog.records)
        finally:
            node.shutdown()
