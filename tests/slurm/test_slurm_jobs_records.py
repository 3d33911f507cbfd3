"""What the live multi-job benchmark records per job, so that each job's ratio can be taken apart: whom it
waited for and who overtook it, the nodes it held over time, its rounds and their pauses. Pure functions
of the benchmark's rows and events; no cluster."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.slurm_jobs.__main__ import PolicyRun, decisions, queue_order, round_downtime
from elastic_rm.obs.events import Event


def _row(arrival: float, start: float | None, sizes: list[list[float]]) -> dict:
    return {"arrival_s": arrival, "start_s": start, "sizes": sizes}


def test_a_backfill_is_recorded_as_an_overtaking():
    """This trace's static timeline: j05 (5 nodes, arrives at 180 s) waits while j03 and j04 hold 5 of
    8 nodes; j06 (3 nodes, arrives at 240 s) fits the 3 free ones and starts first."""
    rows = {
        "j03": _row(80, 148, [[148, 4], [315, 0]]),
        "j04": _row(130, 148, [[148, 1], [331, 0]]),
        "j05": _row(180, 366, [[366, 5], [516, 0]]),
        "j06": _row(240, 240, [[240, 3], [368, 0]]),
    }
    j05, j06 = queue_order("j05", rows), queue_order("j06", rows)
    assert j05 == {"waited_for": ["j03", "j04", "j06"], "overtaken_by": ["j06"], "overtook": []}
    assert j06 == {"waited_for": [], "overtaken_by": [], "overtook": ["j05"]}
    assert queue_order("j03", rows)["overtook"] == []  # started in its arrival order


def test_a_job_that_never_started_waited_for_everyone_who_held_nodes():
    rows = {"a": _row(0, None, []), "b": _row(10, 12, [[12, 2]])}
    assert queue_order("a", rows) == {"waited_for": ["b"], "overtaken_by": ["b"], "overtook": []}


def test_a_rounds_pause_is_the_gap_in_steps_after_its_decision():
    stalls = [[50.0, 6.0], [120.5, 4.2], [300.0, 5.0]]  # [start, seconds]
    assert round_downtime(120.0, None, stalls) == 4.2  # drained 0.5 s after the decision
    assert round_downtime(121.0, None, stalls) == 4.2  # its last step just before the decision
    assert round_downtime(200.0, None, stalls) is None  # no step paused within 30 s of it
    assert round_downtime(0.0, None, []) is None
    # a job's first round (no step before it) followed 6 s later by a scale-up whose pause it is
    assert round_downtime(34.0, 40.0, [[40.1, 14.8]]) is None
    assert round_downtime(40.0, None, [[40.1, 14.8]]) == 14.8


def test_the_progress_file_gives_the_pauses(tmp_path: Path):
    run = PolicyRun("elastic", None, None, tmp_path, "0", 1, t0=1000.0)
    row = {"last_step": None, "stalls": []}
    progress = tmp_path / "progress.json"
    run.record_step(row, progress)  # not there yet: nothing
    for t in (1010.0, 1011.0, 1012.0, 1019.5, 1020.4):
        progress.write_text(json.dumps({"samples_done": 1, "time": t}))
        run.record_step(row, progress)
        run.record_step(row, progress)  # polled twice between two steps: the same step
    assert row["stalls"] == [[12.0, 7.5]]


def test_decisions_keep_rounds_demands_and_launcher_actions_in_order():
    def ev(t, kind, **data):
        return Event(t, "r", "", kind, "", data)

    events = [
        ev(1001.0, "launch", action="submit", job="7", node="b1"),
        ev(1003.0, "decision", round=0, world=1, reason="first round"),
        ev(1050.0, "demand", target_nodes=3, reason="scale up"),
        ev(1052.0, "launch", action="queue", waiting_nodes=5),
        ev(1060.0, "decision", round=1, world=3, reason="scale up 1 -> 3"),
        ev(1061.0, "sample", node="b1"),
    ]
    out = decisions(events, 1000.0)
    assert [(d["t"], d["kind"]) for d in out] == [
        (1.0, "launch"),
        (3.0, "round"),
        (50.0, "demand"),
        (52.0, "launch"),
        (60.0, "round"),
    ]
    assert out[0] == {"t": 1.0, "kind": "launch", "action": "submit", "node": "b1", "job": "7"}
    assert out[4] == {"t": 60.0, "kind": "round", "round": 1, "nodes": 3, "reason": "scale up 1 -> 3"}
    assert out[3]["waiting_nodes"] == 5 and out[2]["nodes"] == 3


def test_rows_of_a_static_job_and_of_an_elastic_one(tmp_path: Path):
    """rows() as the benchmark calls it: a static job has no decisions; an elastic one's rounds get their
    pauses."""
    run = PolicyRun("elastic", None, None, tmp_path, "0", 2, t0=1000.0)
    base = {"rc": 0, "node_s": 10.0, "max_nodes": 2, "submit_lag_s": 0.0, "last_step": None}
    run.jobs["a"] = {**base, "arrival": 1000.0, "start": 1010.0, "end": 1100.0, "sizes": [[5.0, 2]]}
    run.jobs["a"]["stalls"] = []
    run.jobs["b"] = {**base, "arrival": 1020.0, "start": 1030.0, "end": 1200.0, "sizes": [[25.0, 1]]}
    run.jobs["b"]["stalls"] = [[60.5, 4.0]]
    run.jobs["b"]["decisions"] = [
        {"t": 29.0, "kind": "round", "round": 1, "nodes": 1, "reason": "first round"},
        {"t": 60.0, "kind": "round", "round": 2, "nodes": 2, "reason": "scale up 1 -> 2"},
    ]
    rows = run.rows()
    assert "decisions" not in rows["a"] and rows["a"]["jct_s"] == 100.0 and rows["a"]["start_s"] == 10.0
    assert [d["downtime_s"] for d in rows["b"]["decisions"]] == [None, 4.0]
    assert rows["b"]["waited_for"] == ["a"] and rows["b"]["overtaken_by"] == []
