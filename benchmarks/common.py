"""What every benchmark shares: where results go and how a table is printed."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from elastic_rm.proc import kill_tree

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict[str, Any]:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
    }


def write_result(name: str, payload: dict[str, Any], results_dir: str = RESULTS) -> str:
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{name}.json")
    body = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        **payload,
    }
    with open(path, "w") as fh:
        json.dump(body, fh, indent=2, sort_keys=True, default=_plain)
    return path


def _plain(value: Any) -> Any:
    """A numpy scalar (a simulator's float64, or the bool of comparing one) as the Python value it holds."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def summarize(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Stop each process this run started, with its children, by its pid (bounded)."""
    for p in procs:
        kill_tree(p.pid)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def end_run(procs: list[subprocess.Popen], etcd: Any, run_id: str, workdir: Path | None = None) -> None:
    """After a run of ``ermrun`` nodes: stop them (by pid) and their etcd, free the run's node memory
    (/dev/shm) and, given, its work directory."""
    stop_processes(procs)
    if etcd is not None:
        etcd.stop()
    shutil.rmtree(Path("/dev/shm/elastic-rm") / run_id, ignore_errors=True)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
