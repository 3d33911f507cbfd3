"""`erm report` of a recorded run renders, names each decision and survives malformed records; measured
gains and prediction errors are the leader's outcome records."""

from __future__ import annotations

import contextlib
import io
import os

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.run_report import error_histogram, load_run, write_report
from elastic_rm.obs.status import job_status
from elastic_rm.wire.keyspace import Keyspace
from launcher.erm import main as erm_main
from tests.obs import recorded_run


def test_measured_gain_and_error_are_the_leaders_outcome_records(run_id, tmp_path):
    """From a file alone (no etcd): the outcome events give each decision its measured gain and error."""
    file_path = tmp_path / "events.jsonl"
    file_path.write_text("".join(e.to_json() + "\n" for e in recorded_run.events(run_id)))
    data = load_run(run_id, None, files=(str(file_path),))
    by_round = {d["round"]: d for d in data.decisions}
    assert by_round[1]["measured_gain"] is None and by_round[1]["prediction_error"] is None
    assert by_round[2]["measured_gain"] == 1300.0 / 1000.0 - 1
    assert by_round[2]["prediction_error"] == 0.4 - (1300.0 / 1000.0 - 1)
    assert by_round[3]["measured_gain"] == 950.0 / 1300.0 - 1 and by_round[3]["prediction_error"] is None
    assert sum(n for _, n in error_histogram(data.decisions)) == 1  # decisions without an error: not counted
    hist = dict(error_histogram([{"prediction_error": e} for e in (0.78, -0.3, -2.0, 0.0, 0.05, None)]))
    assert hist["+50% .. +100%"] == 1 and hist["-50% .. -25%"] == 1 and hist["< -100%"] == 1
    assert hist["-10% .. +10%"] == 2 and sum(hist.values()) == 5


def test_report_of_a_recorded_run_renders_and_names_each_decision(etcd, run_id, tmp_path):
    keys = Keyspace("/elastic-rm", run_id)
    file_path = str(tmp_path / "n0.events.jsonl")
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        written = recorded_run.write(c, keys, file_path)
        c.put(keys.record(9), b'{"v": 1, "round": "nine"}')
        c.put(keys.events + "00000000000000000001-x-000000", b"\xff")
        data = load_run(run_id, c, files=(file_path,))
        shown = job_status(c, keys)["decisions"]  # erm status: the same figures from etcd's events alone
    assert [(d["round"], d["downtime_s"], d["redone_steps"]) for d in shown] == [
        (1, None, None),
        (2, 2.4, 0),
        (3, 4.9, 7),
    ]
    assert len(data.events) == len(written)  # etcd's copy and the file's merge without duplicates
    assert [d["round"] for d in data.decisions] == [1, 2, 3]
    assert any("rounds/00000009/record" in m for m in data.errors)
    assert any("00000000000000000001-x-000000" in m for m in data.errors)
    png, page, labels = write_report(data, str(tmp_path / "out"))
    for number, _, members, reason, _ in recorded_run.ROUNDS:
        assert any(
            label.startswith(f"round {number}: {len(members)} node(s), {reason}"[:60]) for label in labels
        )
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000
    html = open(page, encoding="utf-8").read()
    assert "data:image/png;base64,iVBORw0KGgo" in html  # the PNG itself, embedded
    for _, _, _, reason, _ in recorded_run.ROUNDS:
        assert f"<td>{reason}</td>" in html
    assert "+40.0%" in html and "+30.0% (1,000 &rarr; 1,300 samples/s, vs round 1)" in html
    assert (
        "Prediction error" in html and "<td>+10.0%</td><td>step 400, 2.40 s, 0</td></tr>" in html
    )  # round 2: +40% predicted, +30% measured
    # each round's restore: the slowest node's downtime, the most steps any node trained again
    assert [(d["restored_step"], d["downtime_s"], d["redone_steps"]) for d in data.decisions] == [
        (None, None, None),
        (400, 2.4, 0),
        (780, 4.9, 7),
    ]
    assert "<td>step 400, 2.40 s, 0</td>" in html and "<td>step 780, 4.90 s, 7</td>" in html
    assert "rounds/00000009/record" in html  # malformed records are listed, not fatal


def erm(*args: str) -> tuple[int, str, str]:
    """`erm ARGS` in this process (a subprocess would spend seconds importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = erm_main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_erm_report_from_a_file_alone(run_id, tmp_path):
    file_path = tmp_path / "events.jsonl"
    file_path.write_text("".join(e.to_json() + "\n" for e in recorded_run.events(run_id)) + "not json\n")
    code, out, err = erm("report", run_id, "--events", str(file_path), "-o", str(tmp_path / "o"))
    assert code == 0, err
    assert "3 decision(s)" in out and f"events.jsonl:{len(recorded_run.events(run_id)) + 1}" in err
    assert (tmp_path / "o" / f"{run_id}.png").stat().st_size > 20_000
    code, _, err = erm("report", "other-run", "--events", str(file_path), "-o", str(tmp_path))
    assert code == 2 and "nothing recorded for run 'other-run'" in err
