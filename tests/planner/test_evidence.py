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


@pytest.mark.slow  # 7 s of simulations: make test-all
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


def _job(req: int, start: float, *decisions: str):
    from types import SimpleNamespace

    return SimpleNamespace(trace=SimpleNamespace(req_nodes=req), start_s=start, decisions=list(decisions))


def _causes(job, static_start: float = 0.0) -> set[str]:
    from benchmarks.planner.evidence import CAUSES

    s = _job(job.trace.req_nodes, static_start)
    d = " | ".join(job.decisions)
    return {name for name, test in CAUSES if test(job, s, d)}


def test_the_causes_tell_a_start_planned_small_from_one_the_cluster_started_short():
    planned = _job(
        8, 0.0, "0s: first round of 4 node(s); warm start from 3 finished run(s) of a-1: 4 node(s)"
    )
    assert _causes(planned) == {"start below the request (the warm start's size)"}
    short = _job(
        8,
        0.0,
        "0s: first round of 3 node(s); warm start from 3 finished run(s) of a-1: 12 node(s)",
        "60s: scale up 3 -> 12: toward the start size 12 (warm start ...)",
    )
    assert _causes(short) == {"start short of its size (too few free nodes)"}  # the catch-up is no scale-up
    cold = _job(8, 0.0, "0s: first round of 2 node(s); cold start: no finished run of a-1; 8 node(s), memory")
    assert _causes(cold) == {"start short of its size (too few free nodes)"}
    assert _causes(_job(8, 120.0, "0s: first round of 8 node(s); cold start: x; 8 node(s), m"), 60.0) == {
        "queued longer"
    }


def test_the_causes_tell_scale_downs_below_the_request_from_give_backs_and_reverts():
    first = "0s: first round of 8 node(s); cold start: x; 8 node(s), m"
    below = _job(8, 0.0, first, "600s: scale down 8 -> 6: the user's 8 node(s): fewer would lose > 3%")
    assert _causes(below) == {"scale-down below the request"}
    past = _job(
        8, 0.0, first, "600s: scale up 8 -> 10: the next node up to 10 brings >= 20% of an average node"
    )
    assert _causes(past) == {"stage-2 scale-up"}
    back = _job(
        8,
        0.0,
        first,
        "600s: scale up 8 -> 10: the next node up to 10 brings >= 20% of an average node",
        "900s: scale down 10 -> 8: 4 node(s) wanted by queued jobs; nodes lent past the request given back",
    )
    assert _causes(back) == {"stage-2 scale-up", "lent nodes given back"}
    revert = _job(8, 0.0, first, "1200s: scale down 12 -> 8: stop-loss: 12 node(s) measured below the rate")
    assert _causes(revert) == {"stop-loss"}
    above = _job(8, 0.0, first, "1200s: scale down 12 -> 9: nodes beyond 9 bring < 15% of an average node")
    assert _causes(above) == {"scale-down, not below the request"}
    memory = _job(8, 0.0, first, "900s: OOM predicted on n1 in 300 s (10 GiB, +2 GiB/h); memory budget to 14")
    assert _causes(memory) == {"memory raised (OOM predicted)"}
