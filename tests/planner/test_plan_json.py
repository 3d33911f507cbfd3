"""`erm plan --json` is JSON (no NaN), and observations it cannot fit are refused with the field's name."""

from __future__ import annotations

import json

import pytest

from launcher.erm import main

from .helpers import JOB


def _strict(text: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_plan_json_of_one_observed_size_is_strict_json(tmp_path, capsys):
    """The R^2 of a fit on one size is undefined: it was written as NaN, which JSON parsers refuse."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "observations": [{"world": 2, "step_s": 0.1}]}))
    rc = main(["plan", str(path), "--json"])
    out = capsys.readouterr().out
    data = _strict(out)
    assert rc == 0 and data["stage2"]["r2"] is None and data["stage2"]["target_world"] >= 1


@pytest.mark.parametrize("field, value", [("step_s", 1e299), ("step_s", 1e-300), ("capacity", 1e-300)])
def test_plan_refuses_an_observation_no_run_could_measure(tmp_path, capsys, field, value):
    """A step of 1e299 s overflowed the model fit (OverflowError traceback); 1e-300 planned on NaN."""
    obs = {"world": 2, "step_s": 0.1, field: value}
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "observations": [obs]}))
    rc = main(["plan", str(path), "--json"])
    out = capsys.readouterr()
    assert rc == 2 and f"observations[0]: field '{field}' must be between" in out.err, out.err
    assert not out.out
