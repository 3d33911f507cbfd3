"""A spare puts on ``sys.path`` what ``python -u script.py`` would: the directory of the script's real file
(Python resolves a symlinked script), and, under ``-P`` / ``PYTHONSAFEPATH``, no directory at all (and it
keeps the user's first ``PYTHONPATH`` entry, which it used to delete as if it were its own directory)."""

from __future__ import annotations

import os

import pytest

from elastic_rm.agent.spares import SparePool
from elastic_rm.guard import Watchdog

SCRIPT = "import helper\nprint('helper', helper.WHERE)\n"


@pytest.fixture
def pool():
    guard = Watchdog()
    p = SparePool(("json",), guard)
    yield p
    p.close()
    guard.release()


def _run(pool: SparePool, script: str, env: dict[str, str], tmp_path) -> tuple[int, str]:
    pool.fill(1, low_priority=False)
    spare = pool.take()
    assert spare is not None
    out = tmp_path / "out.log"
    with open(out, "w") as stream:
        spare.hand([script], env, stream, stream)
    return spare.proc.wait(30), out.read_text()


def test_a_symlinked_script_imports_the_modules_beside_its_target(pool, tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir(), link.mkdir()
    (real / "helper.py").write_text("WHERE = 'real'\n")
    (real / "train.py").write_text(SCRIPT)
    (link / "train.py").symlink_to(real / "train.py")
    code, out = _run(pool, str(link / "train.py"), {"PATH": os.environ["PATH"]}, tmp_path)
    assert code == 0, out  # was: ModuleNotFoundError: No module named 'helper'
    assert "helper real" in out


def test_safe_path_keeps_the_first_pythonpath_entry(pool, tmp_path, monkeypatch):
    lib, scripts = tmp_path / "lib", tmp_path / "scripts"
    lib.mkdir(), scripts.mkdir()
    (lib / "helper.py").write_text("WHERE = 'lib'\n")
    (scripts / "train.py").write_text(SCRIPT)
    (scripts / "helper.py").write_text("WHERE = 'beside the script'\n")  # -P: never imported
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # the spare starts with this environment, as the agent's
    monkeypatch.setenv("PYTHONPATH", str(lib))
    code, out = _run(pool, str(scripts / "train.py"), dict(os.environ), tmp_path)
    assert code == 0, out  # was: ModuleNotFoundError (the spare deleted sys.path[0], the PYTHONPATH entry)
    assert "helper lib" in out
