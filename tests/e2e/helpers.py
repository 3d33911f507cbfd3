"""Start ermrun/torchrun nodes as real processes and read what their workers logged."""

from __future__ import annotations

import faulthandler
import glob
import logging
import os
import signal
import subprocess
import sys
import time

from elastic_rm.demo.harness import jsonl_rows
from launcher import ermrun as ermrun_module
from tests.conftest import BIN, REPO, Proc

STEPS = os.path.join(REPO, "tests", "workers", "steps.py")


def ermrun(tmp_path, node: str, args: list[str], steps_max: int = 0, extra_env: dict | None = None) -> Proc:
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": node, "STEPS_MAX": str(steps_max), **(extra_env or {})}
    argv = [os.path.join(BIN, "ermrun"), "--monitor-interval", "0.1", *args, STEPS]
    return Proc(argv, str(tmp_path / f"{node}.agent.log"), env=env)


def records(tmp_path, node: str) -> list[dict]:
    return [row for path in sorted(glob.glob(str(tmp_path / f"{node}-*.jsonl"))) for row in jsonl_rows(path)]


def wait_until(predicate, timeout: float, what: str, procs=()) -> float:
    """Poll until predicate() is true; returns the time it took. Fails with the agents' logs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.log_path}\n{p.output()[-3000:]}" for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def steps_at_world(tmp_path, node: str, world: int, since: float = 0.0) -> int:
    return sum(
        1 for r in records(tmp_path, node) if r.get("world") == world and "step" in r and r["t"] >= since
    )


PY = sys.executable


def exit_code_after(p, timeout: float, stderr=None) -> int:
    """``p``'s exit code within ``timeout``; a process still running then is made to dump every thread's
    stack (it must run with ``PYTHONFAULTHANDLER=1``; SIGABRT) and the failure shows where it hung.
    ``stderr``: reads what it wrote there (default: ``p.stderr``)."""
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        masks = signal_masks(p.pid)
        p.send_signal(signal.SIGABRT)
        p.wait(10)
        dump = stderr() if stderr is not None else p.stderr.read()
        raise AssertionError(
            f"still running {timeout:.0f}s later; {masks}; its threads:\n{dump[-6000:]}"
        ) from None


def signal_masks(pid: int) -> str:
    """The process's pending, blocked, ignored and caught signals, and each thread's blocked set
    (/proc): whether a signal it did not act on was ignored, blocked or went to another thread."""
    try:
        with open(f"/proc/{pid}/status") as f:
            process = [
                line.strip()
                for line in f
                if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
            ]
        threads = []
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                blocked = next((line.split()[1] for line in f if line.startswith("SigBlk")), "?")
            threads.append(f"{tid}:{blocked}")
    except OSError as exc:
        return f"no /proc status ({exc})"
    return f"{' '.join(process)}; threads' SigBlk {' '.join(threads)}"


def ermrun_here(argv: list[str]) -> int:
    """ermrun.run(argv) in this process, its exit status (an argparse SystemExit's code included): for an
    input ermrun refuses before any worker starts, without the seconds a process of its own spends
    importing torch. What run() changes in the process is put back: the environment (the agent sets
    MALLOC_ARENA_MAX, ERM_NNODES... for its workers), the root logger, SIGTERM's handler (the node's
    leave) and the SIGUSR1 stack dump. tests/e2e/test_ermrun_cli.py keeps a real ermrun process refusing
    a flag, with its exit code and message."""
    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return ermrun_module.run(argv)
    except SystemExit as exc:  # argparse's refusal: the process's exit status
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGTERM, sigterm)
        root.handlers[:] = handlers
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
