"""What keeps a run of many nodes bounded: the event log's size with many writers, events of big rounds,
one round parse per process."""

from __future__ import annotations

import json

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs import events as ev
from elastic_rm.obs.events import ids_for_event
from elastic_rm.rendezvous.view import parse_round
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord


class RecordingReads:
    """An etcd client for a trim that records what the trim read: its keys and the revision."""

    def __init__(self, client: EtcdClient, reads: list[tuple[int, list[str]]]):
        self._client, self._reads = client, reads

    def get_prefix(self, prefix: str):
        kvs, revision = self._client.get_prefix(prefix)
        self._reads.append((revision, [kv.key for kv in kvs]))
        return kvs, revision

    def txn(self, *args, **kwargs):
        return self._client.txn(*args, **kwargs)


def test_many_writers_keep_the_event_log_near_keep(etcd, run_id, monkeypatch):
    """300 writers with 3 events each: a trim counted per writer (every TRIM_EVERY of its own events) would
    never run and leave 900 events; trimming one event in TRIM_EVERY at random trims the run's whole log.

    A trim deletes what it read: events sent without waiting and still in flight when it reads land after
    it (etcd applies concurrent requests in any order), and the next trim takes them. So the test checks
    what the trims recorded: the last one ran after the last request, and of the events it read only the
    newest ``keep`` are left; every other event left landed after its read."""
    monkeypatch.setattr(ev, "TRIM_EVERY", 5)
    real_trim, real_run_soon = ev.trim, ev.run_soon
    order: list[str] = []  # "request" and "trim", in the order they happened
    reads: list[tuple[int, list[str]]] = []

    def recording_trim(client, keys, keep):
        order.append("trim")
        return real_trim(RecordingReads(client, reads), keys, keep)

    def recording_run_soon(slot, job, name):
        order.append("request")
        real_run_soon(slot, job, name)

    monkeypatch.setattr(ev, "trim", recording_trim)
    monkeypatch.setattr(ev, "run_soon", recording_run_soon)
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=10) as c:
        logs = [ev.EventLog(run_id, f"n{i}", client=c, keys=keys, keep=40) for i in range(300)]
        for k in range(3):
            for log in logs:
                log.emit("checkpoint", f"checkpoint {k}", step=k)
        assert logs[-1].flush(10)  # its last event is in etcd and no trim runs
        left, _ = c.get_prefix(keys.events)
    assert "request" in order and order[-1] == "trim"  # trims ran; none was drawn after the last one
    revision, read = reads[-1]
    assert [kv.key for kv in left if kv.mod_revision <= revision] == read[-40:]


def test_events_of_a_big_round_give_the_count_not_the_ids():
    small = ids_for_event(members=("a", "b"), standby=("c",))
    assert small == {"world": 2, "members": ("a", "b"), "standby": ("c",)}
    members = tuple(f"host-{i:05d}-abcdef" for i in range(1024))
    big = ids_for_event(members=members, standby=())
    assert big == {"world": 1024, "members_count": 1024, "standby": ()}
    event = ev.Event(0.0, "r", "n", "decision", "round 2", big)
    assert len(event.to_json()) < ev.MAX_VALUE_BYTES


def test_a_round_value_is_parsed_once_per_process():
    record = RoundRecord(round=3, members=("a", "b"), reason="x", leader="a", time=1.0)
    raw = record.to_json()
    first = parse_round("/elastic-rm/r/round", bytes(raw))
    again = parse_round("/elastic-rm/r/round", bytes(raw))  # another handler's copy of the same value
    assert first is again and first.members == ("a", "b")
    other = json.loads(raw)
    other["round"] = 4
    assert parse_round("/elastic-rm/r/round", json.dumps(other).encode()).round == 4
