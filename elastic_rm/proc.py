"""Stopping a launched node for good: the process, its group, and every descendant.

torch's agent starts each worker in a session of its own, so signalling the agent's process group does not
reach the workers; a node killed that way leaves them running. Collect the descendants first, then signal
all of them by pid.
"""

from __future__ import annotations

import os
import signal

import psutil


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group and to each of its descendants (their own groups too)."""
    procs = tree(pid)
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def kill_tree(pid: int, timeout: float = 5.0) -> None:
    """SIGCONT (a stopped process cannot die of SIGTERM), then SIGKILL to the whole tree; wait for it."""
    procs = tree(pid)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        signal_tree(pid, sig)
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(procs, timeout=timeout)
