"""Ground truth of a simulated job: step time, CPU and memory per node from the trace's hidden columns.

Deliberately not the planner's model: it adds a per-stage collective latency (log2 w), runs the CPU input
pipeline concurrently with the whole step (prefetching; a node starved of cores makes the step wait for
its input and then uses all its cores), and scales real table bytes by a hidden factor, so neither the
planner nor the Optimus-style baseline can fit it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .trace import GIB, TraceJob


@dataclass(frozen=True)
class Step:
    step_s: float  # the synchronous step: slowest node + communication + fixed
    busy_s: tuple[float, ...]  # each node's own time (what it reports as p50)
    cpu_used: tuple[float, ...]  # cores per node
    gpu_util: tuple[float, ...]


def table_bytes(job: TraceJob) -> float:
    return job.n_tables * job.rows_per_table * job.dim * 4.0


def comm_s(job: TraceJob, w: int) -> float:
    if w <= 1:
        return 0.0
    emb = job.n_tables * job.dim * 4.0
    a2a = job.t_a2a_eff * job.global_batch * emb * (w - 1) / (w * w * job.bandwidth)
    ar = job.t_ar_eff * 2.0 * job.dense_params * 4.0 * (w - 1) / (w * job.bandwidth)
    return a2a + ar + job.t_latency_s * math.log2(w)


def step(job: TraceJob, slowdowns: list[float], cpus: list[float]) -> Step:
    """One step on nodes with these slowdowns (>= 1) and allocated cores."""
    w = len(slowdowns)
    per_node = job.global_batch / w
    comm = comm_s(job, w) + job.t_fixed_s
    comps = [job.t_compute * per_node / job.gpus_per_node * s for s in slowdowns]
    datas = [job.cpu_per_sample * per_node / max(cpu - job.cpu_base, 0.25) for cpu in cpus]
    t = max(max(comps) + comm, max(datas))
    cpu_used = tuple(min(job.cpu_base + job.cpu_per_sample * per_node / t, cpu) for cpu in cpus)
    gpu = tuple(min(c / t, 1.0) for c in comps)
    busy = tuple(max(c + comm, d) for c, d in zip(comps, datas, strict=True))
    return Step(t, busy, cpu_used, gpu)


def hurt(job: TraceJob, progress: float) -> TraceJob:
    """The job as it runs at this fraction of its work: past ``skew_at_frac`` its samples cost
    ``skew_factor`` x the compute (data skew: the same model meets other data)."""
    if job.skew_at_frac and progress >= job.skew_at_frac:
        return replace(job, t_compute=job.t_compute * job.skew_factor)
    return job


def ideal_step(job: TraceJob, w: int) -> float:
    """Step time with enough cores and no straggler (used by the generator to place the knee)."""
    return step(job, [1.0] * w, [1e9] * w).step_s


def mem_used(job: TraceJob, w: int, progress: float) -> float:
    """Bytes per node at a fraction ``progress`` of the work: tables grow linearly with samples seen."""
    tables = (
        table_bytes(job) * job.mem_table_factor * (1 + job.mem_growth_frac * min(max(progress, 0.0), 1.0))
    )
    sharded = tables * (1 + job.opt_factor) / w
    dense = job.dense_params * 4.0 * (1 + job.opt_factor)
    act = job.act_bytes_per_sample * job.global_batch / w
    return job.mem_overhead_gib * GIB + sharded + dense + act


def knee(job: TraceJob, lo: int, hi: int, min_gain: float = 0.2) -> int:
    """The true marginal-gain optimum, by the planner's rule (perf_model.best_world) on the true curve."""
    tp = {w: 1.0 / ideal_step(job, w) for w in range(lo, hi + 1)}
    w = lo
    for k in range(lo + 1, hi + 1):
        if tp[k] - tp[w] >= min_gain * (k - w) * tp[w] / w:
            w = k
    return w
