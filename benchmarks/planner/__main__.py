"""`python -m benchmarks.planner`: the three policies on one generated trace, the table, ratios, JSON.

Targets (issue 4, from the paper's headline): mean JCT >= 31% below static and below Optimus-style; CPU
utilisation >= +15 points and memory utilisation >= +20 points over static; completion rate not below
static. The table reports what was measured; the target lines say met or NOT met.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import write_result
from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Instability
from elastic_rm.planner.sim.report import write_json
from elastic_rm.planner.sim.runner import payload, run_policies, table
from elastic_rm.planner.sim.tracegen import generate


def targets(s: dict) -> list[tuple[str, bool, str]]:
    st, op, us = s["static"], s["optimus"], s["ours"]
    jct = us["mean_jct_s"] / st["mean_jct_s"] - 1
    return [
        ("mean JCT >= 31% below static", jct <= -0.31, f"{jct:+.1%}"),
        (
            "mean JCT below Optimus-style",
            us["mean_jct_s"] < op["mean_jct_s"],
            f"{us['mean_jct_s'] / op['mean_jct_s'] - 1:+.1%}",
        ),
        (
            "CPU util >= +15 points",
            (us["cpu_util"] - st["cpu_util"]) * 100 >= 15,
            f"{(us['cpu_util'] - st['cpu_util']) * 100:+.1f} pt",
        ),
        (
            "memory util >= +20 points",
            (us["mem_util"] - st["mem_util"]) * 100 >= 20,
            f"{(us['mem_util'] - st['mem_util']) * 100:+.1f} pt",
        ),
        (
            "completion rate >= static",
            us["completion_rate"] >= st["completion_rate"],
            f"{(us['completion_rate'] - st['completion_rate']) * 100:+.1f} pt",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--machines", type=int, default=48)
    p.add_argument("--load", type=float, default=0.85)
    p.add_argument("--ablation", action="store_true", help="also run ours-fixed-size (no per-node resizing)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/planner.json)")
    a = p.parse_args(argv)
    spec, inst = ClusterSpec(machines=a.machines), Instability()
    t0 = time.perf_counter()
    jobs = generate(a.jobs, a.seed, spec, a.load)
    policies = ("static", "optimus", "ours") + (("ours-fixed-size",) if a.ablation else ())
    result = run_policies(jobs, spec, a.seed, policies, inst)
    s = result["summary"]
    print(f"planner benchmark: {len(jobs)} jobs (seed {a.seed}, load {a.load}), {spec.machines} machines x "
          f"({spec.cores:g} cores, {spec.mem_gib:g} GiB, {spec.gpus} GPUs); "
          f"wall {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(table(s))
    print()
    checks = targets(s)
    for name, ok, value in checks:
        print(f"  {'met    ' if ok else 'NOT met'}  {name:<32} {value}")
    data = payload(
        result, spec, inst, a.seed, f"generated(n={a.jobs}, seed={a.seed}, load={a.load})", len(jobs)
    )
    data["targets"] = {name: {"met": ok, "value": value} for name, ok, value in checks}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        write_json(a.out, data)
        path = a.out
    else:
        path = write_result("planner", data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
