"""`erm simulate`'s figure for the live multi-job trace: python -m benchmarks.slurm_jobs.simulate.

The simulator runs the same 12 arrivals on 8 one-GPU machines, static against the planner, with
each job's ground truth fitted to its emulated speed-up curve: a step is ``t_compute * B / w`` plus an
all-reduce term ``A (w - 1) / w`` plus a latency ``L log2 w`` (A, L >= 0 by non-negative least squares on
the curve's step times at 1..8 nodes). Time is scaled by ``SCALE``: the simulator's ticks (60 s), planner
calls (120 s) and round pause (60 s) are hours-long jobs' steps, so the trace's seconds become
``SCALE`` simulated seconds and the JCTs are divided back. No faults are injected (the live run has none).
Writes benchmarks/results/slurm-jobs-sim.json.
"""

from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import nnls

from benchmarks.common import write_result
from benchmarks.slurm_jobs.trace import GLOBAL_BATCH, NODES, STEP_S, TRACE
from benchmarks.slurm_jobs.trace import TraceJob as LiveJob
from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Instability
from elastic_rm.planner.sim.regret import ratios
from elastic_rm.planner.sim.runner import run_policies
from elastic_rm.planner.sim.trace import TraceJob

SCALE = 30.0  # simulated seconds per live second
BANDWIDTH = 1e9
DENSE = 1_000_000
SEED = 1
# ours-fixed-size is the planner with the user's per-node CPU and memory: as live, where erm launch applies
# the planner's node count but not its per-node budgets (ours also resizes the nodes at round boundaries)
# ours-fixed-size-call-in: the same with early starts called in by later jobs, as erm launch --call-in
# does (elastic_rm.launch.slurm_call_in), which the live benchmark's elastic jobs use
POLICIES = ("static", "ours", "ours-fixed-size", "ours-fixed-size-call-in")
LIVE_LIKE = "ours-fixed-size-call-in"


def fit_comm(job: LiveJob) -> tuple[float, float]:
    """(A, L) so that STEP_S / w + A (w - 1) / w + L log2 w follows the curve's step times (live seconds)."""
    worlds = np.arange(1, NODES + 1)
    target = np.array([STEP_S / job.speedup(int(w)) - STEP_S / w for w in worlds])
    basis = np.column_stack([(worlds - 1) / worlds, np.log2(worlds)])
    (a, lat), _ = nnls(basis, np.maximum(target, 0.0))
    return float(a), float(lat)


def sim_job(job: LiveJob) -> TraceJob:
    a, lat = fit_comm(job)
    wire = 2.0 * DENSE * 4.0 / BANDWIDTH  # an all-reduce's wire time at t_ar_eff 1, times (w-1)/w
    return TraceJob(
        job_id=job.name,
        submit_s=job.submit_s * SCALE,
        name=job.name,
        global_batch=GLOBAL_BATCH,
        n_tables=1,
        rows_per_table=1000,
        dim=8,
        dense_params=DENSE,
        opt_factor=1.0,
        bandwidth=BANDWIDTH,
        gpus_per_node=1,
        req_nodes=job.nodes,
        req_min_nodes=1,
        req_max_nodes=NODES,
        req_cpu_per_node=4.0,
        req_mem_gib_per_node=8.0,
        work_samples=float(job.samples),
        t_compute=STEP_S * SCALE / GLOBAL_BATCH,
        t_a2a_eff=0.0,
        t_ar_eff=a * SCALE / wire,
        t_fixed_s=0.0,
        t_latency_s=lat * SCALE,
        cpu_base=0.5,
        cpu_per_sample=1e-6,
        mem_overhead_gib=1.0,
        mem_table_factor=1.0,
        act_bytes_per_sample=0.0,
        mem_growth_frac=0.0,
        error_at_frac=0.0,
    )


def simulate(trace=TRACE) -> dict:
    jobs = [sim_job(j) for j in trace]
    spec = ClusterSpec(machines=NODES, cores=16.0, mem_gib=64.0, gpus=1)
    inst = Instability(fail_per_node_h=0.0, straggler_per_node_h=0.0)
    result = run_policies(jobs, spec, SEED, policies=POLICIES, inst=inst)
    per_job = ratios(result["runs"])
    out: dict = {"scale": SCALE, "seed": SEED, "live_like": LIVE_LIKE}
    for name, run in result["runs"].items():
        done = [j for j in run if j.status == "completed"]
        jct = {j.trace.job_id: (j.end_s - j.trace.submit_s) / SCALE for j in done}
        out[name] = {
            "completed": len(done),
            "mean_jct_s": sum(jct.values()) / len(jct) if jct else None,
            "mean_queue_s": sum((j.start_s - j.trace.submit_s) / SCALE for j in done) / max(len(done), 1),
            "node_hours": sum(j.node_s for j in run) / SCALE / 3600,
            "jct_s": jct,
            # each job's first step, live seconds from the trace's start: who started before whom
            "start_s": {j.trace.job_id: j.start_s / SCALE for j in done},
            "rounds_per_job": sum(j.rounds for j in run) / len(run),
            "called_in": sorted(j.trace.job_id for j in run if j.called_in),
            "per_job_ratio": per_job[name],
            "max_job_ratio": max(per_job[name].values()),
        }
        if name != "static":
            out[name]["mean_jct_ratio"] = out[name]["mean_jct_s"] / out["static"]["mean_jct_s"]
    out["fits"] = {j.name: dict(zip(("ar_s", "latency_s"), fit_comm(j), strict=True)) for j in trace}
    return out


def main() -> int:
    out = simulate()
    for name in POLICIES:
        x = out[name]
        line = f"{name}: mean JCT {x['mean_jct_s']:.0f} s (live seconds), "
        line += f"mean queueing {x['mean_queue_s']:.0f} s"
        if name != "static":
            line += f"; {x['mean_jct_ratio']:.2f}x static, worst job {x['max_job_ratio']:.2f}x"
        print(line)
    print("wrote", write_result("slurm-jobs-sim", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
