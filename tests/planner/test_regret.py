"""Per-job regret: every job's JCT under a policy over its JCT under static, from the same jobs."""

import math

import pytest

from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Simulator
from elastic_rm.planner.sim.regret import RegretError, distribution, quantile, ratios
from elastic_rm.planner.sim.report import compare
from elastic_rm.planner.sim.tracegen import generate

SMALL = ClusterSpec(machines=4)


def _runs(n=10, seed=2, policies=("static", "ours")):
    jobs = generate(n, seed, SMALL)
    return {p: Simulator(jobs, SMALL, p, seed).run() for p in policies}


def test_ratios_are_per_job_against_static_and_static_is_one():
    runs = _runs()
    per_job = ratios(runs)
    assert set(per_job["ours"]) == {j.trace.job_id for j in runs["static"]}
    assert set(per_job["static"].values()) == {1.0}
    static = {j.trace.job_id: j for j in runs["static"]}
    for j in runs["ours"]:
        s = static[j.trace.job_id]
        if j.status == s.status == "completed":
            want = (j.end_s - j.trace.submit_s) / (s.end_s - s.trace.submit_s)
            assert per_job["ours"][j.trace.job_id] == pytest.approx(want)
    summary = compare(runs)
    assert summary["ours"]["jct_ratio_vs_static"] == distribution(per_job["ours"])
    assert summary["static"]["jct_ratio_vs_static"]["share_slowed_5pct"] == 0.0


def test_a_job_missing_from_one_policy_is_an_error_not_a_skipped_row():
    runs = _runs()
    runs["ours"] = runs["ours"][1:]
    with pytest.raises(RegretError, match="policy 'ours'.*missing"):
        ratios(runs)
    with pytest.raises(RegretError, match="missing"):
        compare(runs)
    runs = _runs()
    runs["ours"] = runs["ours"] + runs["ours"][:1]  # a job twice
    with pytest.raises(RegretError, match="policy 'ours'"):
        ratios(runs)


def test_a_job_the_policy_failed_counts_as_slowed():
    runs = _runs()
    victim = next(j for j in runs["ours"] if j.status == "completed")
    victim.status, victim.reason = "failed", "OOM (test)"
    per_job = ratios(runs)["ours"]
    assert per_job[victim.trace.job_id] == math.inf
    d = distribution(per_job)
    assert d["failed_only_here"] == 1 and d["share_slowed_25pct"] >= 1 / len(per_job)
    assert d["p99"] is None  # the top quantile falls on the job that never ended


def test_quantile_is_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert (quantile(xs, 0.5), quantile(xs, 0.9), quantile(xs, 0.99)) == (50.0, 90.0, 99.0)
    assert quantile([3.0], 0.99) == 3.0
