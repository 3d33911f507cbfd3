"""History records as a user hands them to `erm plan`, and the ``history_max`` setting that bounds them."""

from __future__ import annotations

import json

import pytest

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.history import HistoryError, parse_record, warm_start
from elastic_rm.planner.job import parse_job
from launcher.erm import main

from .helpers import JOB

SIG = parse_job(JOB).signature()
RECORD = {
    "v": 1,
    "signature": SIG,
    "run_id": "r1",
    "finished_at": 1.0,
    "status": "completed",
    "world_size": 5,
    "throughput": 1000.0,
    "cpu_per_node_used": 4.0,
    "mem_per_node_peak_bytes": 8e9,
}


def test_history_max_zero_uses_no_record():
    """records[-0:] is every record: "use the latest 0 runs" warm-started from all of them."""
    job, rec = parse_job(JOB), parse_record(RECORD)
    start = warm_start(job, [rec], 1, 8, PlannerConfig(history_max=0))
    assert not start.warm and start.from_history == 0 and "cold start" in start.reason
    assert warm_start(job, [rec], 1, 8, PlannerConfig(history_max=1)).warm


def test_plan_honours_history_max_zero(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "planner": {"history_max": 0}, "history": [RECORD]}))
    rc = main(["plan", str(path)])
    out = capsys.readouterr()
    assert rc == 0 and "cold start" in out.out and "warm start" not in out.out, out.err


def test_plan_refuses_a_misspelt_history_field(tmp_path, capsys):
    """ "coeff" for "coef": the record's model prior was silently dropped."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "history": [{**RECORD, "coeff": [1e-5, 0, 0, 0.01]}]}))
    rc = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "history[0]: unknown field 'coeff'; did you mean 'coef'?" in err, err


def test_a_written_record_reads_back_in_erm_plan(tmp_path, capsys):
    """Every field the writer (HistoryRecord.to_dict) puts in a record is one erm plan accepts."""
    record = parse_record({**RECORD, "coef": [1e-5, 0.0, 0.0, 0.01], "duration_s": 60.0}).to_dict()
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "history": [record]}))
    rc = main(["plan", str(path)])
    out = capsys.readouterr()
    assert rc == 0 and "warm start from 1 finished run" in out.out, out.err


@pytest.mark.parametrize("field", ["mem_per_node_peak_bytes", "throughput", "world_size"])
def test_a_record_of_absurd_size_is_refused(tmp_path, capsys, field):
    """A peak of 1e308 bytes (an OOM run's, doubled) planned "inf GiB per node"."""
    with pytest.raises(HistoryError, match=f"field '{field}' must be <= 1e\\+18"):
        parse_record({**RECORD, field: 1e308})
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "history": [{**RECORD, "status": "oom", field: 1e308}]}))
    rc = main(["plan", str(path)])
    out = capsys.readouterr()
    assert rc == 2 and f"history[0]: field '{field}' must be <= 1e+18" in out.err and not out.out, out.err
