"""Part (b): throughput of a CPU loop of fixed work per step (~10 ms on an idle core) under ermrun (monitor
+ step reporting + embedded etcd) against stock torchrun (no reporting: the API is a no-op there),
alternating runs in one session. Each step does the same work under both, so what the agent takes from
the workers' cores is lost steps per second."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.agent_overhead.loop_worker import WORK_ITERS

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def one_run(launcher: str, window_s: float, nproc: int, iters: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="erm-loop-")) / "out.json"
    argv = [
        str(BIN / launcher),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(HERE / "loop_worker.py"),
        str(window_s),
        str(iters),
    ]
    env = {**os.environ, "LOOP_OUT": str(out), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=window_s + 180)
    if result.returncode != 0:
        raise RuntimeError(f"{launcher} failed:\n{result.stderr[-2000:]}")
    data = json.loads(out.read_text())
    out.unlink()
    out.parent.rmdir()
    return {
        "steps_per_s": data["steps"] / data["seconds"],
        "rank0_cpu_per_step_ms": 1e3 * data["cpu_s"] / data["steps"],
    }


def throughput(
    runs: int = 3, window_s: float = 20.0, nproc: int = 2, iters: int = WORK_ITERS
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"torchrun": [], "ermrun": []}
    cpu: dict[str, list[float]] = {"torchrun": [], "ermrun": []}
    load_start = os.getloadavg()
    for _ in range(runs):
        for launcher in ("torchrun", "ermrun"):  # alternate, so drifting load hits both alike
            r = one_run(launcher, window_s, nproc, iters)
            rates[launcher].append(r["steps_per_s"])
            cpu[launcher].append(r["rank0_cpu_per_step_ms"])
    t, e = statistics.median(rates["torchrun"]), statistics.median(rates["ermrun"])
    return {
        "runs": runs,
        "window_s": window_s,
        "nproc_per_node": nproc,
        "work_iters_per_step": iters,
        "steps_per_s": rates,
        "rank0_cpu_per_step_ms": cpu,
        "median_torchrun": t,
        "median_ermrun": e,
        "ermrun_over_torchrun": e / t,
        "slowdown": 1.0 - e / t,
        "target_slowdown": 0.01,
        "load_avg_at_start": load_start,
        "load_avg_at_end": os.getloadavg(),
    }
