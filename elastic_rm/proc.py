"""Processes of this host: whether one runs, and stopping a launched node for good (the process, its
group, and every descendant).

torch's agent starts each worker in a session of its own, so signalling the agent's process group does not
reach the workers; a node killed that way leaves them running. Collect the descendants first, then signal
all of them by pid.
"""

from __future__ import annotations

import os
import signal

import psutil

from . import guard


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group and to each of its descendants (their own groups too), but
    not to owner watchdogs (elastic_rm.guard): a node killed this way must still be cleaned up after, as
    when only its agent is killed. They end by themselves once their owner is gone."""
    procs = [p for p in tree(pid) if not _is_watchdog(p)]
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _is_watchdog(p: psutil.Process) -> bool:
    try:
        return p.cmdline()[1:2] == [os.path.abspath(guard.__file__)]
    except (psutil.Error, IndexError):
        return False


def kill_tree(pid: int, timeout: float = 5.0) -> None:
    """SIGCONT (a stopped process cannot die of SIGTERM), then SIGKILL to the whole tree; wait for it.
    Owner watchdogs (elastic_rm.guard) go last: once their owners are dead they remove the temporary
    directories those owners left, and exit by themselves."""
    procs = tree(pid)
    watchdogs = [p for p in procs if _is_watchdog(p)]
    others = [p for p in procs if p not in watchdogs]
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(pid, sig)  # watchdogs run in sessions of their own: not in this group
        except (ProcessLookupError, PermissionError):
            pass
        for p in others:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(others, timeout=timeout)
    _, alive = psutil.wait_procs(watchdogs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
