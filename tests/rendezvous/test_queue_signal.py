"""The leader's reading of the queue key: a record its writer stopped refreshing counts as unknown."""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.rendezvous.queue_signal import QueueSignal
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import QUEUE_STALE_AFTER_S, QUEUE_WRITE_EVERY_S, QueueRecord


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_record_left_unchanged_past_three_refreshes_is_unknown_until_rewritten(etcd, caplog):
    keys = Keyspace("/elastic-rm", f"queue-stale-{time.monotonic_ns()}")
    clock = Clock()
    assert QUEUE_STALE_AFTER_S == 3 * QUEUE_WRITE_EVERY_S
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        signal = QueueSignal(client, keys, every_s=1.0, clock=clock)
        client.put(keys.queue, QueueRecord(3, "test", time=1.0).to_json())
        assert signal.waiting_nodes() == 3
        clock.now += QUEUE_STALE_AFTER_S  # unchanged, but not yet older than three refreshes
        assert signal.waiting_nodes() == 3
        clock.now += 1.0  # the writer is gone (a killed erm launch): the frozen count is no signal
        assert signal.waiting_nodes() is None
        clock.now += 60.0
        assert signal.waiting_nodes() is None
        assert sum("unchanged for more than 15s" in r.getMessage() for r in caplog.records) == 1
        client.put(keys.queue, QueueRecord(3, "test", time=2.0).to_json())  # a refresh, the same count
        clock.now += 1.0
        assert signal.waiting_nodes() == 3
        for written in (3.0, 4.0, 5.0):  # refreshed every QUEUE_WRITE_EVERY_S: never stale
            clock.now += QUEUE_WRITE_EVERY_S
            client.put(keys.queue, QueueRecord(0, "test", time=written).to_json())
            assert signal.waiting_nodes() == 0


def test_running_nodes_count_only_from_a_fresh_record(etcd):
    keys = Keyspace("/elastic-rm", f"queue-running-{time.monotonic_ns()}")
    clock = Clock()
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        signal = QueueSignal(client, keys, every_s=1.0, clock=clock)
        assert signal.running_nodes() == 0  # no record: a run without erm launch --slurm
        client.put(keys.queue, QueueRecord(0, "test", time=time.time(), running_nodes=4).to_json())
        clock.now += 1.0
        assert signal.running_nodes() == 4
        clock.now += QUEUE_STALE_AFTER_S + 1.0  # unchanged since: its writer is gone
        assert signal.running_nodes() == 0
        old = time.time() - QUEUE_STALE_AFTER_S - 60  # written long ago by the writer's clock
        client.put(keys.queue, QueueRecord(0, "test", time=old, running_nodes=4).to_json())
        clock.now += 1.0
        assert signal.running_nodes() == 0
        assert signal.waiting_nodes() == 0  # the planner's count keeps its own rule
        client.put(keys.queue, b'{"v":1,"waiting_nodes":0,"running_nodes":-1}')
        clock.now += 1.0
        assert signal.running_nodes() == 0
