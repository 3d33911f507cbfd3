"""`erm report` takes the run as docs/operate.md says the commands that show a run do: RUN or --run-id,
the only run when none is named, and an unknown run is an error naming the runs there."""

from __future__ import annotations

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs import run_report
from elastic_rm.obs.events import Event
from elastic_rm.wire.keyspace import Keyspace
from launcher.erm import main

from . import recorded_run

PREFIX = "/elastic-rm"


def _decision(run: str) -> str:
    data = {"round": 1, "members": ["n0"], "reason": "first round", "predicted_gain": None}
    return Event(recorded_run.T0, run, "n0", "decision", "round 1", data).to_json() + "\n"


def report(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["report", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_only_run_of_the_files_is_reported_without_naming_it(tmp_path, capsys, monkeypatch):
    drawn = []  # the run's data, not the picture (drawing it is test_report.py's, and takes seconds)
    monkeypatch.setattr(
        run_report, "write_report", lambda data, *a, **k: drawn.append(data) or ("p", "h", [])
    )
    path = tmp_path / "n0.events.jsonl"
    path.write_text(_decision("job7"))
    rc, out, err = report(capsys, "--events", str(path), "-o", str(tmp_path / "out"))
    assert rc == 0 and [d.run_id for d in drawn] == ["job7"] and "1 decision(s)" in out, err


def test_run_id_is_taken_as_run(tmp_path, capsys):
    """`--run-id` was "unrecognized arguments" although docs/operate.md lists it for report."""
    path = tmp_path / "n0.events.jsonl"
    path.write_text(_decision("job7"))
    rc, _, err = report(capsys, "--run-id", "other", "--events", str(path), "-o", str(tmp_path / "o"))
    assert rc == 2 and "nothing recorded for run 'other'" in err, err
    rc, _, err = report(capsys, "job7", "--run-id", "other", "--events", str(path))
    assert rc == 2 and "differ" in err


def test_files_of_several_runs_need_the_run_named(tmp_path, capsys):
    path = tmp_path / "n0.events.jsonl"
    path.write_text(_decision("job7") + _decision("job8"))
    rc, _, err = report(capsys, "--events", str(path), "-o", str(tmp_path / "o"))
    assert rc == 2 and "pass RUN (runs in the files: job7, job8)" in err, err


def test_an_unknown_run_in_etcd_names_the_runs_there(etcd, run_id, tmp_path, capsys):
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        keys = Keyspace(PREFIX, run_id)
        recorded_run.write(c, keys, str(tmp_path / "n0.events.jsonl"))
        c.put(keys.leader, "n0")  # a run erm status lists
    rc, _, err = report(capsys, "--run-id", "no-such-run", "--endpoint", etcd.endpoint)
    assert rc == 2 and "no run 'no-such-run' under /elastic-rm" in err and run_id in err, err
