"""The planner benchmark's evidence: where each policy's GPUs went, and the rerun on the same jobs."""

import pytest

from benchmarks.planner.__main__ import run_same_jobs
from benchmarks.planner.evidence import completion_split
from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Instability, Simulator
from elastic_rm.planner.sim.tracegen import generate

SMALL = ClusterSpec(machines=4)


@pytest.fixture(scope="module")
def oom_runs():
    jobs = generate(30, 2, SMALL, family="oom-heavy")
    return jobs, {p: Simulator(jobs, SMALL, p, 2).run() for p in ("static", "optimus", "ours")}


def test_completion_split_accounts_every_gpu_hour_and_names_the_jobs_only_one_policy_completed(oom_runs):
    _, runs = oom_runs
    split = completion_split(runs)
    done = {p: {j.trace.job_id for j in js if j.status == "completed"} for p, js in runs.items()}
    common = done["static"] & done["optimus"] & done["ours"]
    assert split["common_jobs"] == len(common)
    for p, js in runs.items():
        v = split["by_policy"][p]
        assert sum(v["gpu_hours"].values()) == pytest.approx(sum(j.usage[4] for j in js) / 3600)
        assert v["jobs_completed_not_by_optimus"] == len(done[p] - done["optimus"]) * (p != "optimus")
        queue = [j.start_s - j.trace.submit_s for j in js if j.trace.job_id in common]
        assert v["mean_queue_common_s"] == pytest.approx(sum(queue) / len(queue))
    # growing tables: the planner completes jobs that Optimus-style's OOM restarts fail, and spends GPUs there
    ours = split["by_policy"]["ours"]
    assert ours["jobs_completed_not_by_optimus"] > 0
    assert ours["gpu_hours"]["completed_not_by_optimus"] > 0
    assert split["by_policy"]["optimus"]["gpu_hours"]["completed_not_by_optimus"] == 0


def test_same_jobs_reruns_the_trace_without_every_job_a_policy_failed(oom_runs, capsys):
    jobs, runs = oom_runs
    failed = {j.trace.job_id for js in runs.values() for j in js if j.status != "completed"}
    assert failed  # oom-heavy on 4 machines: some job fails under some policy
    out = run_same_jobs("oom-heavy", jobs, runs, 2, SMALL, Instability())
    assert out["dropped_jobs"] == len(failed) and out["jobs"] == len(jobs) - len(failed)
    assert set(out["policies"]) == {"static", "optimus", "ours"}
    assert all(v["common_jobs"] <= out["jobs"] for v in out["policies"].values())
    assert "mean JCT <= Optimus-style" in out["targets"]
    slower = out["slower_than_static"]
    assert slower["jobs_slower"] <= slower["jobs_compared"] <= out["jobs"]
    assert f"without the {len(failed)} jobs any policy failed" in capsys.readouterr().out


def test_perturbed_traces_change_only_the_compute_time_and_by_a_few_parts_in_a_trillion():
    from dataclasses import fields

    from benchmarks.planner.perturb import EPSILON, perturbed, ratios, spread

    jobs = generate(12, 2, SMALL)
    a, b = perturbed(jobs, 1), perturbed(jobs, 2)
    assert a != jobs and a != b and perturbed(jobs, 1) == a  # another draw per k, the same for the same k
    for j, p in zip(jobs, a, strict=True):
        assert abs(p.t_compute / j.t_compute - 1) == pytest.approx(EPSILON, rel=1e-3)
        assert all(getattr(p, f.name) == getattr(j, f.name) for f in fields(j) if f.name != "t_compute")
    out = spread(jobs, 2, SMALL, Instability(), 2)
    assert len(out["runs"]) == 2
    for key, (lo, hi) in out["range"].items():
        assert lo == min(r[key] for r in out["runs"]) and hi == max(r[key] for r in out["runs"])
    s = {
        p: {"mean_jct_s": m, "median_jct_s": m / 2}
        for p, m in (("ours", 90.0), ("static", 100.0), ("optimus", 120.0))
    }
    assert ratios(s) == pytest.approx(
        {
            "mean_vs_static": -0.1,
            "mean_vs_optimus": -0.25,
            "median_vs_static": -0.1,
            "median_vs_optimus": -0.25,
        }
    )
