import math
import re

import pytest

from elastic_rm.planner.config import GIB
from elastic_rm.planner.job import JobSpecError, parse_job
from elastic_rm.planner.memory_model import (
    estimate_node_memory,
    fit_trend,
    rescale_observed,
    time_to_limit,
)

from .helpers import JOB


@pytest.mark.parametrize(
    "job, field",
    [
        ([], "expected a JSON object"),
        ({**JOB, "tables": []}, "'tables'"),
        ({**JOB, "tables": [{"rows": 0, "dim": 4}]}, r"tables\[0\]: field 'rows'"),
        ({**JOB, "global_batch": "big"}, "'global_batch'"),
        ({**JOB, "global_batch": True}, "'global_batch'"),
        ({**JOB, "request": {"cpu_per_node": 4}}, r"request: missing field 'nodes'"),
        ({k: v for k, v in JOB.items() if k != "dense_params"}, "missing field 'dense_params'"),
    ],
)
def test_bad_job_descriptions_name_the_field(job, field):
    with pytest.raises(JobSpecError, match=field):
        parse_job(job)


def test_signature_ignores_resources_but_not_shapes():
    a = parse_job(JOB)
    b = parse_job({**JOB, "request": {"nodes": 9}})
    c = parse_job({**JOB, "tables": [{"rows": 1_000_001, "dim": 64}] * 4})
    assert a.signature() == b.signature() != c.signature()
    assert a.signature().startswith("unit-")


def test_memory_estimate_shards_tables_and_replicates_dense():
    job = parse_job(JOB)
    m1, m4 = estimate_node_memory(job, 1, GIB), estimate_node_memory(job, 4, GIB)
    assert m1.tables == pytest.approx(4 * m4.tables)
    assert m1.dense == m4.dense and m1.overhead == m4.overhead == GIB
    assert m1.tables == 4 * 1_000_000 * 64 * 4
    # an observation at 4 nodes carried to 2: the sharded part doubles, the fixed part stays
    used4 = m4.total * 1.1
    used2 = rescale_observed(used4, m4, estimate_node_memory(job, 2, GIB))
    assert used4 < used2 < 2 * used4


def test_trend_and_time_to_limit():
    pts = [(t, 10 * GIB + 2e6 * t) for t in range(0, 600, 120)]
    tr = fit_trend(pts)
    assert tr.slope == pytest.approx(2e6)
    assert time_to_limit(tr, tr.level + 2e6 * 300) == pytest.approx(300)
    assert time_to_limit(tr, tr.level - 1) == 0.0
    flat = fit_trend([(t, 5.0) for t in range(5)])
    assert math.isinf(time_to_limit(flat, 10.0))
    assert fit_trend(pts[:2]) is None  # two points are not a trend


def test_job_planner_section_overrides_config_field_by_field():
    from elastic_rm.planner.config import PlannerConfig, config_from_job

    cfg = config_from_job(
        {"planner": {"sample_interval_s": 2, "cooldown_s": 20.5, "window": 4, "profiling": False}}
    )
    assert (cfg.sample_interval_s, cfg.cooldown_s, cfg.window, cfg.profiling) == (2, 20.5, 4, False)
    assert cfg.straggler_k == PlannerConfig().straggler_k
    assert config_from_job({}) == PlannerConfig()
    for bad, message in [
        ({"sample_intervl_s": 2}, "unknown field 'sample_intervl_s'"),
        ({"window": 2.5}, "whole number"),
        ({"cooldown_s": -1}, "number >= 0"),
        ({"cooldown_s": True}, "number >= 0"),
        ({"profiling": 1}, "true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            config_from_job({"planner": bad})
    with pytest.raises(ValueError, match="JSON object"):
        config_from_job({"planner": [1]})


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(globl_batch=8), "unknown field 'globl_batch'; did you mean 'global_batch'?"),
        (lambda d: d["tables"][0].update(dims=8), "job.tables[0]: unknown field 'dims'; did you mean 'dim'?"),
        (lambda d: d["request"].update(node=2), "job.request: unknown field 'node'; did you mean 'nodes'?"),
        (lambda d: d.update(observations=[]), "unknown field 'observations'"),  # erm plan's, not the job's
    ],
)
def test_a_job_field_nobody_reads_is_an_error_with_a_suggestion(mutate, message):
    job = {"global_batch": 64, "tables": [{"rows": 10, "dim": 4}], "dense_params": 5, "request": {"nodes": 1}}
    parse_job(job)
    mutate(job)
    with pytest.raises(JobSpecError, match=re.escape(message)):
        parse_job(job)
