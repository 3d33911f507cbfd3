"""Wait for the agents' exit; an agent still running at the deadline prints its threads' stacks first
(`ermrun` dumps them on SIGUSR1), so that a failed wait shows where it hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.conftest import Proc


def exit_codes(nodes: dict[str, Proc], timeout: float) -> dict[str, int | None]:
    """Each node's exit status within `timeout` seconds in all; None for a node still running then (its
    stacks are in its output)."""
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for name, proc in nodes.items():
        try:
            codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    for name, proc in nodes.items():
        if codes[name] is None:
            os.kill(proc.pid, signal.SIGUSR1)
    if None in codes.values():
        time.sleep(2)  # the dump is written by the signal handler at once; give the log a moment
    return codes
