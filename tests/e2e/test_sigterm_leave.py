"""ermrun's SIGTERM before workers run (launcher/ermrun.py `_sigterm_leaves`) starts the node's leave
once: a second SIGTERM during that leave (Slurm's scancel arriving right after the node's own signal)
must not cut the cleanup short. A real process and real signals."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, signal, time
from torch.distributed.elastic.multiprocessing.api import SignalException
from launcher.ermrun import _sigterm_leaves

_sigterm_leaves()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
except SignalException as e:
    print("leaving", e.sigval.name, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the second one, while the leave runs
    time.sleep(0.3)
    print("left", flush=True)
"""


def test_a_second_sigterm_during_the_leave_does_not_cut_it_short() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["leaving SIGTERM", "left"], (proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "SIGTERM again: still leaving the rendezvous" in proc.stderr
