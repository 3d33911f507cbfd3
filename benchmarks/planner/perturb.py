"""How far a family's figures move when nothing that matters changes: the same trace with every job's hidden
compute time changed by a few parts in 10^12 (far below anything a policy could measure), run again.

A simulated cluster is chaotic: every decision moves the next job's start, its warm start and the queue
the others see, so a last-bit difference (a fit on other BLAS kernels, one more fsum) ends in other
decisions and other means. The spread of these runs is the noise floor of one seed's comparison: a
difference between policies inside it is not a property of the policies.
"""

from __future__ import annotations

import random
from dataclasses import replace

from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Instability
from elastic_rm.planner.sim.runner import run_policies
from elastic_rm.planner.sim.trace import TraceJob

EPSILON = 1e-12  # relative change of each job's compute time


def perturbed(jobs: list[TraceJob], k: int) -> list[TraceJob]:
    """The trace with every job's ``t_compute`` times (1 +- EPSILON), signs drawn from seed ``k``."""
    rng = random.Random(k)
    return [replace(j, t_compute=j.t_compute * (1 + rng.choice((-1, 1)) * EPSILON)) for j in jobs]


def ratios(summary: dict) -> dict[str, float]:
    us, st, op = summary["ours"], summary["static"], summary["optimus"]
    return {
        f"{stat}_vs_{base}": us[f"{stat}_jct_s"] / ref[f"{stat}_jct_s"] - 1
        for stat in ("mean", "median")
        for base, ref in (("static", st), ("optimus", op))
    }


def spread(jobs: list[TraceJob], seed: int, spec: ClusterSpec, inst: Instability, runs: int) -> dict:
    """``runs`` perturbed copies of the trace, each with static, Optimus-style and the planner: the planner's
    ratios in each, and their min and max."""
    each = []
    for k in range(1, runs + 1):
        s = run_policies(perturbed(jobs, k), spec, seed, ("static", "optimus", "ours"), inst)["summary"]
        each.append(ratios(s))
    keys = each[0] if each else {}
    return {
        "epsilon": EPSILON,
        "runs": each,
        "range": {key: [min(r[key] for r in each), max(r[key] for r in each)] for key in keys},
    }
