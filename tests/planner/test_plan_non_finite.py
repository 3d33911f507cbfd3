"""`erm plan` observations that json reads and no job measured: a NaN or a 400-digit step time."""

from __future__ import annotations

import json

import pytest

from launcher.erm import main

from .helpers import JOB


@pytest.mark.parametrize(
    "step_s, why",
    [
        (float("nan"), "a plan of NaN: '4 -> 1 node(s)', predicted gain +nan%"),
        (float("inf"), "an infinite step time"),
        (int("9" * 400), "float() raised OverflowError: a traceback, exit 1"),
    ],
)
def test_a_non_finite_step_time_is_one_line_and_exit_2(tmp_path, capsys, step_s, why):
    obs = [{"world": 2, "step_s": step_s}, {"world": 4, "step_s": 0.05}]
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "observations": obs}))
    rc = main(["plan", str(path)])
    out = capsys.readouterr()
    assert rc == 2, why
    assert "observations[0]: field 'step_s' must be a finite number > 0" in out.err
    assert "nan" not in out.out
