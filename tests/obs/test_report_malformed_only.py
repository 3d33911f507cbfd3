"""`erm report` on event files whose every line is malformed: the lines are listed (file and line), not
only "nothing recorded", which sent the user to check the run id."""

from __future__ import annotations

import json

from launcher.erm import main


def test_report_lists_the_malformed_lines_when_nothing_else_was_read(tmp_path, capsys):
    path = tmp_path / "n0.events.jsonl"
    path.write_text(json.dumps({"v": 1, "time": 1.0, "run": "r1", "kind": "decision"}) + "\n{truncated\n")
    rc = main(["report", "r1", "--events", str(path), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "nothing recorded for run 'r1'" in err
    assert f"malformed (skipped): {path}:1: field 'node'" in err, err
    assert f"malformed (skipped): {path}:2: not a JSON event" in err
