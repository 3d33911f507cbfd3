"""One simulation run of several policies on one trace: the summary, the JSON payload and the plots."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from .cluster import ClusterSpec
from .engine import POLICIES, Instability, Simulator
from .report import compare, plot, table, write_html, write_json
from .trace import TraceJob


def run_policies(
    jobs: list[TraceJob],
    spec: ClusterSpec,
    seed: int,
    policies: tuple[str, ...] = POLICIES,
    inst: Instability | None = None,
    tick_s: float = 60.0,
) -> dict:
    """Simulate every policy on the same trace and seeds; returns summary, runs, timelines, timings."""
    runs, timelines, seconds = {}, {}, {}
    for p in policies:
        t0 = time.perf_counter()
        sim = Simulator(jobs, spec, p, seed, inst, tick_s=tick_s)
        runs[p] = sim.run()
        timelines[p] = sim.timeline
        seconds[p] = time.perf_counter() - t0
    return {"summary": compare(runs), "runs": runs, "timelines": timelines, "seconds": seconds}


def payload(result: dict, spec: ClusterSpec, inst: Instability, seed: int, trace: str, n_jobs: int) -> dict:
    s = result["summary"]
    base = s.get("static", {})
    ratios = {}
    for name, v in s.items():
        if name == "static" or not base:
            continue
        ratios[name] = {
            "mean_jct_vs_static": v["mean_jct_s"] / base["mean_jct_s"] - 1
            if base.get("mean_jct_s")
            else None,
            "mean_jct_common_vs_static": (v["mean_jct_common_s"] / base["mean_jct_common_s"] - 1)
            if base.get("mean_jct_common_s")
            else None,
            "cpu_util_points": (v["cpu_util"] - base["cpu_util"]) * 100,
            "mem_util_points": (v["mem_util"] - base["mem_util"]) * 100,
            "completion_rate_points": (v["completion_rate"] - base["completion_rate"]) * 100,
        }
    return {
        "v": 1,
        "trace": trace,
        "jobs": n_jobs,
        "seed": seed,
        "cluster": asdict(spec),
        "instability": asdict(inst),
        "policies": s,
        "ratios": ratios,
        "wall_seconds": result["seconds"],
    }


def write_outputs(result: dict, data: dict, out_dir: str, plots: bool = True) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "result.json")
    write_json(path, data)
    paths = [path]
    if plots:
        images = plot(result["runs"], result["timelines"], result["summary"], out_dir)
        page = write_html(os.path.join(out_dir, "report.html"), result["summary"], images, data["trace"])
        paths += images + [page]
    return paths


__all__ = ["run_policies", "payload", "write_outputs", "table"]
