"""`erm events --file F --run-id R` prints run R's events only: an --event-log file is appended to, so one
file may hold several runs (erm report picks the run the same way)."""

from __future__ import annotations

from elastic_rm.obs.events import EventLog
from launcher.erm import main as erm_main


def test_run_id_selects_the_run_in_an_event_log_file(tmp_path, capsys):
    path = tmp_path / "a.events.jsonl"
    for run in ("job1", "job2"):
        log = EventLog(run, "a", path=path)
        log.emit("job", f"started on {run}", status="started")
        log.close()
    assert erm_main(["events", "--file", str(path), "--run-id", "job2"]) == 0
    out = capsys.readouterr().out
    assert "started on job2" in out and "started on job1" not in out  # --run-id was ignored with --file
    assert erm_main(["events", "--file", str(path)]) == 0  # without it: every run in the file
    out = capsys.readouterr().out
    assert "started on job1" in out and "started on job2" in out


def test_follow_of_several_files_is_refused_before_anything_is_listed(tmp_path, capsys):
    paths = []
    for node in ("a", "b"):
        log = EventLog("job1", node, path=tmp_path / f"{node}.jsonl")
        log.emit("job", f"started on {node}", status="started")
        log.close()
        paths += ["--file", str(tmp_path / f"{node}.jsonl")]
    assert erm_main(["events", *paths, "--follow"]) == 2
    out, err = capsys.readouterr()
    assert "--follow follows one --file" in err and out == ""  # was: the whole listing, then exit 2
