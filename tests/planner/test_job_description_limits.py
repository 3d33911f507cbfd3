"""Job descriptions a user can write that parse_job and `erm plan` let through before: an ``oom_count`` the
leader's memory rules cannot read, numbers whose products overflow a float, a misspelt observation field,
history records of another job."""

from __future__ import annotations

import json

import pytest

from elastic_rm.planner.job import parse_job
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.rendezvous.settings import _load_job
from launcher.erm import main

from .helpers import JOB, feed, running


@pytest.mark.parametrize("bad", ["x", 1.5, -1, [1], float("nan")])
def test_a_bad_oom_count_is_refused_at_start_not_by_the_leader(bad, tmp_path):
    """ermrun --job accepted it, and the leader's memory rules then raised int("x") at the first sample."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "oom_count": bad}))
    with pytest.raises(ValueError, match="field 'oom_count' must be"):
        _load_job(str(path))


@pytest.mark.parametrize("count", [1, None])  # null: the memory rules read it as 0
def test_a_valid_oom_count_is_accepted_and_planned_with(count):
    job = {**JOB, "oom_count": count}
    parse_job(job)
    answers, _ = feed(PlannerPolicy(), [running(t, ["a", "b"], job=job) for t in (0.0, 30.0)])
    assert len(answers) == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("tables", [{"rows": 10**300, "dim": 10**300}]),  # rows x dim overflowed: OverflowError from erm plan
        ("optimizer_state_factor", 1e300),  # an optimizer of inf GiB, printed as "inf"
        ("bytes_per_param", 10**200),
    ],
)
def test_plan_refuses_numbers_whose_products_overflow(tmp_path, capsys, field, value):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, field: value}))
    rc = main(["plan", str(path), "--json"])
    out = capsys.readouterr()
    assert rc == 2 and "must be <= 1e+18" in out.err and "job.json" in out.err, out.err
    assert "Traceback" not in out.err and not out.out


def test_plan_refuses_a_misspelt_observation_field(tmp_path, capsys):
    """Every other field's typo is an error naming the closest field; "capcity" planned with capacity 1."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "observations": [{"world": 2, "step_s": 0.1, "capcity": 0.5}]}))
    rc = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "observations[0]: unknown field 'capcity'; did you mean 'capacity'?" in err, err


def _record(signature: str) -> dict:
    return {
        "v": 1,
        "signature": signature,
        "run_id": "r1",
        "finished_at": 1.0,
        "status": "completed",
        "world_size": 3,
        "throughput": 1000.0,
        "cpu_per_node_used": 4.0,
        "mem_per_node_peak_bytes": 8e9,
    }


def test_plan_refuses_history_of_another_job_and_warm_starts_from_its_own(tmp_path, capsys):
    """A record of another signature (the job renamed, its batch changed) was silently a cold start."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "history": [_record("other-0123456789abcdef")]}))
    rc = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "history[0]: field 'signature' is 'other-0123456789abcdef'" in err, err
    assert parse_job(JOB).signature() in err
    path.write_text(json.dumps({**JOB, "history": [_record(parse_job(JOB).signature())]}))
    rc = main(["plan", str(path)])
    out = capsys.readouterr()
    assert rc == 0 and "warm start from 1 finished run" in out.out, out.err
