"""Part (b): throughput of a CPU loop of fixed work per step (~10 ms on an idle core) under ermrun (monitor
+ step reporting + embedded etcd) against stock torchrun (no reporting: the API is a no-op there),
alternating runs in one session. Each step does the same work under both, so what the agent takes from
the workers' cores is lost steps per second. Beside steps/s, each run measures the cores the launcher side
used while the workers trained: the agent's cost, whatever else runs on the machine."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.agent_overhead.loop_worker import WORK_ITERS

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def launcher_cores(proc: subprocess.Popen[str], timeout_s: float, poll_s: float = 0.5) -> float | None:
    """Cores the launcher side used while its workers trained: the launcher process and every descendant
    that is not a worker (ermrun's embedded etcd, its monitor), CPU time over wall time between the second
    and the last poll that saw workers. None when the workers ran too short to tell."""
    import psutil

    seen: dict[int, float] = {}  # pid -> its latest CPU seconds (a process's CPU time only grows)
    marks: list[tuple[float, float]] = []  # (time, launcher-side CPU seconds) while workers ran
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        workers = 0
        for p in tree:
            try:
                if any("loop_worker.py" in a for a in p.cmdline()):
                    workers += 1
                    continue
                t = p.cpu_times()
                seen[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                continue
        if workers:
            marks.append((time.monotonic(), sum(seen.values())))
        time.sleep(poll_s)
    if len(marks) < 3:
        return None
    (t0, c0), (t1, c1) = marks[1], marks[-1]  # from the second poll: the workers' start-up is past
    return (c1 - c0) / (t1 - t0) if t1 > t0 else None


def one_run(launcher: str, window_s: float, nproc: int, iters: int) -> dict[str, float | None]:
    out = Path(tempfile.mkdtemp(prefix="erm-loop-")) / "out.json"
    log = out.with_name("log.txt")
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
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            cores = launcher_cores(proc, window_s + 180)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} failed (rc {proc.returncode}):\n{log.read_text()[-2000:]}")
    data = json.loads(out.read_text())
    for f in (out, log):
        f.unlink()
    out.parent.rmdir()
    return {
        "steps_per_s": data["steps"] / data["seconds"],
        "rank0_cpu_per_step_ms": 1e3 * data["cpu_s"] / data["steps"],
        "launcher_cores": cores,
    }


def throughput(
    runs: int = 3, window_s: float = 20.0, nproc: int = 2, iters: int = WORK_ITERS
) -> dict[str, Any]:
    keys = ("steps_per_s", "rank0_cpu_per_step_ms", "launcher_cores")
    per: dict[str, dict[str, list[Any]]] = {k: {"torchrun": [], "ermrun": []} for k in keys}
    load_start = os.getloadavg()
    for _ in range(runs):
        for launcher in ("torchrun", "ermrun"):  # alternate, so drifting load hits both alike
            r = one_run(launcher, window_s, nproc, iters)
            for k in keys:
                per[k][launcher].append(r[k])
    rates = per["steps_per_s"]
    t, e = statistics.median(rates["torchrun"]), statistics.median(rates["ermrun"])
    cores = {
        name: statistics.median([c for c in v if c is not None]) if any(c is not None for c in v) else None
        for name, v in per["launcher_cores"].items()
    }
    return {
        "runs": runs,
        "window_s": window_s,
        "nproc_per_node": nproc,
        "work_iters_per_step": iters,
        **per,
        "median_torchrun": t,
        "median_ermrun": e,
        "ermrun_over_torchrun": e / t,
        "slowdown": 1.0 - e / t,
        "target_slowdown": 0.01,
        "median_launcher_cores": cores,
        "load_avg_at_start": load_start,
        "load_avg_at_end": os.getloadavg(),
    }
