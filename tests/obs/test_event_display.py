"""The periodic events (samples, checkpoints: about once a second per node) stay in the event log but out
of what a person reads by default: ermrun's console, `erm status`' recent events, the report's events
table and `erm events`; a flag shows them."""

from __future__ import annotations

import io
import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import Event, EventLog
from elastic_rm.obs.run_report import RunData, write_report
from elastic_rm.obs.status import job_status
from elastic_rm.wire.keyspace import Keyspace
from launcher.progress import Progress


def _events(run_id: str) -> list[Event]:
    t = time.time()
    return [
        Event(t, run_id, "a", "checkpoint", "checkpoint of step 20 committed", {"step": 20}),
        Event(t + 1, run_id, "a", "sample", "sample", {"round": 1}),
        Event(t + 2, run_id, "a", "failure", "node b lost", {}),
        Event(t + 3, run_id, "a", "checkpoint", "checkpoint of step 40 committed", {"step": 40}),
    ]


def test_the_console_prints_neither_samples_nor_checkpoints(run_id):
    for mode in ("text", "json"):
        out = io.StringIO()
        progress = Progress(mode, stream=out, live=False)
        for e in _events(run_id):
            progress.on_event(e)
        assert "node b lost" in out.getvalue()
        assert "checkpoint" not in out.getvalue() and "sample" not in out.getvalue(), out.getvalue()


def test_status_recent_events_leave_checkpoints_out_unless_asked(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as c:
        log = EventLog(run_id, "a", client=c, keys=keys)
        for e in _events(run_id):
            log.emit(e.kind, e.message, **e.data)
        assert log.flush()
        shown = [e["kind"] for e in job_status(c, keys)["events"]]
        everything = [e["kind"] for e in job_status(c, keys, all_events=True)["events"]]
    assert shown == ["failure"], shown
    assert sorted(everything) == ["checkpoint", "checkpoint", "failure", "sample"], everything


def test_the_reports_events_table_leaves_checkpoints_out_unless_asked(run_id, tmp_path):
    data = RunData(run_id, _events(run_id), [])
    page = open(write_report(data, str(tmp_path / "quiet"))[1], encoding="utf-8").read()
    assert "node b lost" in page and "checkpoint of step" not in page
    page = open(write_report(data, str(tmp_path / "all"), all_events=True)[1], encoding="utf-8").read()
    assert "checkpoint of step 40 committed" in page
