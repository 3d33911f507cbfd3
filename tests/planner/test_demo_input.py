"""`erm demo --workdir` that cannot be a directory is a usage error said before etcd or a node starts;
a workdir that fails later is a message, not a traceback."""

from __future__ import annotations

import pytest

import launcher.commands.demo as demo_command
from launcher.erm import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["demo", "--no-live", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_a_workdir_that_cannot_be_a_directory_is_refused_at_once(tmp_path, capsys, where):
    existing = tmp_path / "notes.txt"
    existing.write_text("precious")
    workdir = existing if where == "file" else existing / "demo"
    rc, out, err = run(capsys, "--workdir", str(workdir))
    assert rc == 2 and f"erm demo: error: --workdir {workdir}: " in err and "not a directory" in err, err
    assert "Traceback" not in err and "embedded etcd" not in out and existing.read_text() == "precious"


def test_a_workdir_that_fails_when_the_demo_writes_it_is_a_message(tmp_path, capsys, monkeypatch):
    existing = tmp_path / "notes.txt"
    existing.write_text("precious")
    # the workdir turned into a file after the check (or a check that cannot see it coming)
    monkeypatch.setattr(demo_command, "output_dir_problem", lambda path: None)
    rc, out, err = run(capsys, "--workdir", str(existing))
    assert rc == 1 and err.startswith("erm demo: error: ") and "File exists" in err, err
    assert "Traceback" not in err and existing.read_text() == "precious"
