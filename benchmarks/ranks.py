"""Start a benchmark's rank processes and wait for them: one helper for the benchmarks whose ranks are
processes of their own (benchmarks.reshard, benchmarks.delta).

Each rank runs ``python -m <module> <spec> <rank>`` with one OpenMP thread (ranks share the machine's
cores), writing its output to a log file of its own. The wait ends when every rank has exited, when one
has failed (the others would wait for it in a collective), or at the deadline; whatever is left then is
killed, each rank with the processes it started (a rank is the leader of a process group of its own), so
nothing outlives the call. A failed rank's log tail is in the error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.5
TAIL_CHARS = 4000


def run_ranks(
    module: str, spec: Path, nprocs: int, timeout: float, log_of: Callable[[int], Path], what: str
) -> None:
    """Run ranks 0..nprocs-1 of `module` on `spec`; SystemExit naming `what` and the failed ranks when a
    rank fails or the deadline (`timeout` seconds) passes, with the log tail of the lowest-numbered rank
    that failed by itself (the others were killed here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    logs = [open(log_of(r), "w") for r in range(nprocs)]
    procs: list[subprocess.Popen] = []
    killed: list[int] = []
    try:
        for r in range(nprocs):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, str(spec), str(r)],
                    cwd=REPO,
                    env=env,
                    stdout=logs[r],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed with what it started
                )
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(POLL_S)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                killed.append(r)
            try:  # the rank and the processes it started (an exited rank's may be left)
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(timeout=30)
        for f in logs:
            f.close()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        own = [r for r in bad if r not in killed]  # failed by themselves; the others were killed here
        first = own[0] if own else bad[0]
        late = "" if own else f" (killed at the deadline, {timeout:.0f} s)"
        tail = log_of(first).read_text(errors="replace")[-TAIL_CHARS:]
        raise SystemExit(
            f"{what}: ranks {bad} failed{late} (rc {[procs[r].returncode for r in bad]}); "
            f"the log of rank {first} ends:\n{tail}"
        )
