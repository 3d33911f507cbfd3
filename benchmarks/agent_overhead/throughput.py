"""Part (b): throughput of a ~10 ms-per-step CPU loop under ermrun (monitor + step reporting + embedded
etcd) against stock torchrun (no reporting: the API is a no-op there), alternating runs in one session."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def one_run(launcher: str, window_s: float, nproc: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="erm-loop-")) / "out.json"
    argv = [
        str(BIN / launcher),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(HERE / "loop_worker.py"),
        str(window_s),
    ]
    env = {**os.environ, "LOOP_OUT": str(out), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=window_s + 180)
    if result.returncode != 0:
        raise RuntimeError(f"{launcher} failed:\n{result.stderr[-2000:]}")
    data = json.loads(out.read_text())
    return data["steps"] / data["seconds"]


def throughput(runs: int = 3, window_s: float = 20.0, nproc: int = 2) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"torchrun": [], "ermrun": []}
    for _ in range(runs):
        for launcher in ("torchrun", "ermrun"):  # alternate, so drifting load hits both alike
            rates[launcher].append(one_run(launcher, window_s, nproc))
    t, e = statistics.median(rates["torchrun"]), statistics.median(rates["ermrun"])
    return {
        "runs": runs,
        "window_s": window_s,
        "nproc_per_node": nproc,
        "steps_per_s": rates,
        "median_torchrun": t,
        "median_ermrun": e,
        "slowdown": 1.0 - e / t,
    }
