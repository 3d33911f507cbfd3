"""The event log against a real etcd: file and etcd copies agree, compaction keeps the newest, bad values
are errors naming their source."""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs import events as ev
from elastic_rm.wire.keyspace import Keyspace


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_emit_writes_file_and_etcd_in_time_order(etcd, run_id, tmp_path):
    keys = Keyspace("/elastic-rm", run_id)
    path = tmp_path / "events.jsonl"
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        log = ev.EventLog(run_id, "n0", path=path, client=c, keys=keys)
        log.emit("round", "round 1: 2 node(s)", round=1, members=("n0", "n1"))
        log.emit("drain", "drained at step 7", step=7, gain=float("nan"))
        log.close()
        assert _wait_for(lambda: len(ev.read_etcd(c, keys)[0]) == 2)
        from_etcd, errors, revision = ev.read_etcd(c, keys)
    from_file = list(ev.read_file(path))
    assert errors == [] and revision > 0
    assert [e.kind for e in from_etcd] == ["round", "drain"] == [e.kind for e in from_file]
    assert from_etcd[0].data == {"round": 1, "members": ["n0", "n1"]}
    assert from_file[1].data == {"step": 7, "gain": None}  # NaN is not JSON: written as null
    assert ev.merge(from_etcd, from_file) == from_etcd  # the same events from two places count once
    for line in path.read_text().splitlines():
        assert json.loads(line)["run"] == run_id


def test_trim_keeps_the_newest(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        log = ev.EventLog(run_id, "n0", client=c, keys=keys)
        for i in range(12):
            log.emit("checkpoint", f"checkpoint {i}", step=i)
        assert _wait_for(lambda: len(ev.read_etcd(c, keys)[0]) == 12)
        assert ev.trim(c, keys, keep=5) == 7
        kept, _, _ = ev.read_etcd(c, keys)
    assert [e.data["step"] for e in kept] == [7, 8, 9, 10, 11]


def test_a_drawn_trim_runs_off_the_emitting_thread_and_flush_waits_for_it(etcd, run_id, monkeypatch):
    """A node's "round" event comes right before its rank is returned: the trim it may draw (a read of the
    whole log) must not delay it. Trims drawn while one runs make one more trim, and flush waits for it."""
    keys = Keyspace("/elastic-rm", run_id)
    monkeypatch.setattr(ev, "TRIM_EVERY", 1)  # every event draws a trim
    real_trim, trimmed_on = ev.trim, []

    def recording_trim(client, k, keep):
        trimmed_on.append(threading.current_thread().name)
        return real_trim(client, k, keep)

    monkeypatch.setattr(ev, "trim", recording_trim)
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        log = ev.EventLog(run_id, "n0", client=c, keys=keys, keep=3)
        for i in range(10):
            log.emit("checkpoint", f"checkpoint {i}", step=i)
        assert log.flush(10)  # the events are in etcd and no trim runs
        log.emit("checkpoint", "checkpoint 10", step=10)  # its trim reads the ten above at least
        assert log.flush(10)
        kept, _, _ = ev.read_etcd(c, keys)
    assert trimmed_on and set(trimmed_on) == {"erm-events-trim"}
    assert len(trimmed_on) <= 11  # drawn while one ran: folded into the next
    steps = [e.data["step"] for e in kept]
    assert 3 <= len(steps) <= 4 and steps == list(range(11 - len(steps), 11))  # trimmed, the newest kept


def test_a_bad_value_in_etcd_is_reported_by_key(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        c.put(keys.events + "00000000000000000001-x-000000", b"\xff not json")
        c.put(
            keys.events + "00000000000000000002-x-000000",
            b'{"v":1,"time":1,"run":"r","node":"x","kind":"bogus","message":""}',
        )
        events, errors, _ = ev.read_etcd(c, keys)
    assert events == [] and len(errors) == 2
    assert "00000000000000000001-x-000000" in errors[0] and "not a JSON event" in errors[0]
    assert "unknown event kind 'bogus'" in errors[1]


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"[]", "expected a JSON object"),
        (b'{"v":2}', "unsupported event version"),
        (b'{"v":1,"time":"x"}', "field 'time'"),
        (b'{"v":1,"time":1e999}', "field 'time'"),
        (b'{"v":1,"time":1,"run":"r","node":"n","kind":"job","message":"m","data":[]}', "field 'data'"),
        (b"[" * 100000, "not a JSON event"),
    ],
)
def test_parse_rejects_what_we_did_not_write(raw, message):
    with pytest.raises(ev.EventError, match=message) as info:
        ev.Event.parse("src:1", raw)
    assert str(info.value).startswith("src:1")


def test_emit_refuses_unknown_kinds_and_non_json_data(tmp_path):
    log = ev.EventLog("r", "n", path=tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="unknown event kind"):
        log.emit("nope", "x")
    with pytest.raises(TypeError, match="JSON values"):
        log.emit("job", "x", thing=object())
    log.close()
    assert (tmp_path / "e.jsonl").read_text() == ""


def test_an_event_too_large_is_clipped_not_refused(tmp_path):
    """Its sizes come from the run (600 host names, a failed node's long output lines): refused with
    ValueError, such an event ended erm launch and stopped its nodes."""
    log = ev.EventLog("r", "n", path=tmp_path / "e.jsonl")
    hosts = [f"host-{i:04d}-{'x' * 24}" for i in range(600)]
    event = log.emit("launch", "y" * (ev.MAX_VALUE_BYTES + 1), hosts=hosts, count=len(hosts), action="begin")
    log.close()
    assert len(event.to_json()) <= ev.MAX_VALUE_BYTES
    (line,) = (tmp_path / "e.jsonl").read_text().splitlines()
    back = ev.Event.parse("e.jsonl:1", line)
    assert back.message.startswith("y" * ev.CLIPPED_MESSAGE_CHARS)
    assert back.message.endswith(f"({ev.MAX_VALUE_BYTES + 1} characters)")
    assert back.data["count"] == 600 and back.data["action"] == "begin" and "hosts" not in back.data
    assert back.data["clipped"]["fields"] == ["hosts"] and back.data["clipped"]["bytes"] > ev.MAX_VALUE_BYTES


def test_a_file_attached_late_gets_the_earlier_events_and_listeners_see_each_once(tmp_path):
    log = ev.EventLog("r", "n")
    log.emit("leader", "n leads run r")  # before the agent knows the file: the handler emits first
    seen = []
    log.add_listener(seen.append)
    log.attach_file(tmp_path / "e.jsonl")
    log.emit("job", "started", status="started")
    log.add_listener(lambda e: 1 / 0)  # a broken listener is logged, never raised into the emitter
    log.emit("job", "finished", status="succeeded")
    log.close()
    assert [e.message for e in ev.read_file(tmp_path / "e.jsonl")] == ["n leads run r", "started", "finished"]
    assert [e.message for e in seen] == ["n leads run r", "started", "finished"]


def test_trim_keeps_decisions_when_samples_are_many(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        log = ev.EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("decision", "round 1", round=1)
        for i in range(8):
            log.emit("sample", f"sample {i}", round=1, samples_per_s=float(i))
        log.emit("decision", "round 2", round=2)
        log.emit("sample", "sample 8", round=2, samples_per_s=8.0)
        assert log.flush()
        assert _wait_for(lambda: len(ev.read_etcd(c, keys)[0]) == 11)
        assert ev.trim(c, keys, keep=3) == 6  # samples 0-5 go; both decisions stay
        kept, _, _ = ev.read_etcd(c, keys)
    assert [e.message for e in kept] == ["round 1", "sample 6", "sample 7", "round 2", "sample 8"]


def test_follow_delivers_new_events_and_reports_bad_values(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    got, bad = [], []
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        log = ev.EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("job", "before the watch")
        assert log.flush()
        _, _, revision = ev.read_etcd(c, keys)
        cancel = ev.follow_etcd(c, keys, revision + 1, got.append, bad.append)
        try:
            log.emit("failure", "rank 0 exited 3", ranks=[0], exit_codes=[3])
            c.put(keys.events + "99999999999999999999-x-000000", b"garbage")
            assert _wait_for(lambda: got and bad)
        finally:
            cancel()
    assert [e.message for e in got] == ["rank 0 exited 3"] and got[0].data["exit_codes"] == [3]
    assert "99999999999999999999-x-000000" in bad[0] and "not a JSON event" in bad[0]
