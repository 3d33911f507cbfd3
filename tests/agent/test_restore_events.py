"""Restore reports from real worker processes through the worker channel: the reporter counts global
steps from the restored one (on_stop, the drain ack), and the agent's "restore" event says the step, the
worlds, the sources, the steps trained again and the downtime."""

from __future__ import annotations

import json
import os
import struct

import pytest

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.restores import RestoreTracker
from elastic_rm.obs.events import Event, EventLog, read_file
from elastic_rm.train.report import StepReporter
from elastic_rm.wire.channel import (
    HEADER,
    KIND_HELLO,
    KIND_RESTORED,
    KIND_STEPS,
    MAGIC,
    RESTORED_HEAD,
    STEPS,
    VERSION,
)
from elastic_rm.wire.restore import decode_restored, encode_restored

from .test_agent_channel import wait_for


@pytest.fixture
def tracked(tmp_path):
    ch = AgentChannel(window_s=5.0).start()
    events = EventLog("run1", "n0", path=tmp_path / "events.jsonl")
    try:
        yield ch, RestoreTracker(ch, events), tmp_path / "events.jsonl"
    finally:
        events.close()
        ch.close()


def restores(path) -> list[Event]:
    return [e for e in read_file(path) if isinstance(e, Event) and e.kind == "restore"]


def test_a_drained_worker_restored_elsewhere_counts_global_steps_and_redoes_nothing(
    tracked, pyprocs, step_worker, tmp_path
):
    ch, tracker, log = tracked
    first = tmp_path / "first"
    first.mkdir()
    proc = pyprocs.python(step_worker, "--out", str(first), "--step-ms", "10", env=ch.env())
    wait_for(lambda: ch.steps_total >= 20, 10, "the first worker's steps")
    ch.request_drain()
    drained = ch.wait_for_acks(timeout_s=5, pids=[proc.pid]).acked[proc.pid]
    assert proc.wait(timeout=5) == 0
    tracker.mark_change()
    ch.clear_drain()
    # the next worker restores the drained step: its hook and its ack get global steps from there
    second = tmp_path / "second"
    second.mkdir()
    proc = pyprocs.python(
        step_worker, "--out", str(second), "--step-ms", "10", "--restored", str(drained), env=ch.env()
    )
    event = wait_for(lambda: restores(log), 10, "the restore event")[0]
    assert event.data["step"] == drained and event.data["last_step_before"] == drained
    assert event.data["redone_steps"] == 0
    assert event.data["world_before"] == 2 and event.data["world_after"] == 1 and event.data["round"] == 7
    assert event.data["sources"] == {"__0_0.distcp": "peer:n1", ".metadata": "local:n0"}
    assert event.data["files_by_source"] == {"peer:n1": 1, "local:n0": 1}
    assert event.data["downtime_s"] is not None and event.data["downtime_s"] > 0
    assert (
        f"restored step {drained} (saved at world 2) into world 1; 0 step(s) trained again" in event.message
    )
    wait_for(lambda: ch.steps_total >= 40, 10, "the second worker's steps")
    ch.request_drain()
    again = ch.wait_for_acks(timeout_s=5, pids=[proc.pid]).acked[proc.pid]
    assert proc.wait(timeout=5) == 0
    local = [int(x) for x in (second / "log-0.txt").read_text().split()]
    assert again == drained + len(local) == json.loads((second / "ckpt-0.json").read_text())["step"]


def test_after_a_failure_the_steps_past_the_restored_checkpoint_count_as_trained_again(
    tracked, pyprocs, step_worker, tmp_path
):
    ch, tracker, log = tracked
    proc = pyprocs.python(
        step_worker, "--out", str(tmp_path), "--step-ms", "5", "--fail-at", "30", env=ch.env()
    )
    assert proc.wait(timeout=15) != 0  # raised at step 30, as a worker whose collective failed
    assert ch.last_step is not None and ch.last_step[0] == 30  # its exit flushed every step
    tracker.mark_change()
    pyprocs.python(step_worker, "--out", str(tmp_path), "--step-ms", "5", "--restored", "20", env=ch.env())
    event = wait_for(lambda: restores(log), 10, "the restore event")[0]
    assert (event.data["step"], event.data["last_step_before"], event.data["redone_steps"]) == (20, 30, 10)
    assert "10 step(s) trained again" in event.message


def test_malformed_restore_reports_are_dropped_by_the_channel_and_emit_nothing(tracked):
    ch, _tracker, log = tracked
    head = HEADER.pack(MAGIC, VERSION, KIND_RESTORED, 1, 0, 0)
    for body in (b"", b"\xff" * 40, encode_restored(1, 5, 1, 1, {}, 0.0)[:-1] + b"x", os.urandom(300)):
        ch.handle_datagram(head + body)  # never raises
    assert ch.malformed_total == 4 and restores(log) == []


def test_malformed_restore_reports_are_refused():
    good = encode_restored(3, 100, 4, 2, {"a": "durable"}, 1.5)
    assert decode_restored(good).sources == {"a": "durable"}
    for bad in (
        good[:10],
        good[:-1],
        good.replace(b"durable", b'dur"ble'),
        good[: RESTORED_HEAD.size + 1] + b"[1, 2]",
    ):
        with pytest.raises(ValueError):
            decode_restored(bad)


def test_a_worker_kept_in_place_counts_from_its_own_newest_step_when_the_agent_lags(tracked):
    # A round in place after a loss: the worker trained steps whose times it had not sent yet (they go in
    # batches), then restores the checkpoint of step 3. Its report carries its newest step, so the event
    # says the steps trained again and the downtime although the agent never heard of steps past 2.
    ch, tracker, log = tracked
    reporter = StepReporter(ch.directory, flush_interval_s=3600.0)  # sends no step times in this test
    try:
        reporter.send(KIND_HELLO)
        heard = HEADER.pack(MAGIC, VERSION, KIND_STEPS, os.getpid(), 0, 0) + STEPS.pack(2, 0, 1)
        ch.handle_datagram(heard + struct.pack("<2d", 0.01, 0.01))  # the agent's view: 2 steps
        for _ in range(5):
            reporter.step()
        assert ch.last_step[0] == 2 and reporter.newest_step()[0] == 5
        tracker.mark_change()
        body = encode_restored(4, 3, 2, 2, {}, 0.1, step_before=reporter.newest_step())
        reporter.set_step(3)
        reporter.send_after_next_step(KIND_RESTORED, body)
        reporter.step()
        event = wait_for(lambda: restores(log), 5, "the restore event")[0]
    finally:
        reporter.close()
    assert (event.data["step"], event.data["last_step_before"], event.data["redone_steps"]) == (3, 5, 2)
    assert event.data["downtime_s"] is not None and event.data["downtime_s"] >= 0


def test_a_restore_report_round_trips_the_step_before_and_refuses_a_bad_one():
    assert decode_restored(encode_restored(1, 5, 1, 1, {}, 0.0)).step_before is None
    kept = decode_restored(encode_restored(1, 5, 1, 1, {}, 0.0, step_before=(7, 1_800_000_000.5)))
    assert kept.step_before == (7, 1_800_000_000.5)
    for bad in ((-2, 1.0), (7, float("nan")), (7, 0.0)):
        with pytest.raises(ValueError, match="step before"):
            decode_restored(encode_restored(1, 5, 1, 1, {}, 0.0, step_before=bad))
