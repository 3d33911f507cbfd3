"""A job description's numbers that json.load reads and no user means: NaN, Infinity, 400 digits."""

from __future__ import annotations

import json

import pytest

from elastic_rm.planner.job import JobSpecError, parse_job
from elastic_rm.rendezvous.settings import _load_job

from .helpers import JOB

HUGE = int("9" * 400)


@pytest.mark.parametrize(
    "field, bad",
    [
        ("bandwidth", float("nan")),  # NaN >= 1.0 is False: it passed, and the model divided by it
        ("bandwidth", float("inf")),
        ("lookups_per_sample", float("nan")),
        ("optimizer_state_factor", float("inf")),
        ("global_batch", HUGE),  # float(HUGE) raised OverflowError, not the parser's error
        ("dense_params", HUGE),
    ],
)
def test_a_non_finite_number_is_a_job_spec_error_naming_the_field(field, bad, tmp_path):
    d = json.loads(json.dumps(dict(JOB) | {field: bad}))
    with pytest.raises(JobSpecError, match=f"field '{field}' must be a finite number"):
        parse_job(d)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dict(JOB) | {field: bad}))
    with pytest.raises(ValueError, match=f"field '{field}' must be a finite number"):
        _load_job(str(path))  # ermrun --job: one line naming the file and the field, no traceback


def test_a_huge_table_size_is_a_job_spec_error():
    d = dict(JOB) | {"tables": [{"rows": HUGE, "dim": 8}]}
    with pytest.raises(JobSpecError, match=r"tables\[0\]: field 'rows' must be a finite number"):
        parse_job(d)
