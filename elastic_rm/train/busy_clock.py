"""Busy time of the calling thread, for the step reporter (:mod:`elastic_rm.train.report`)."""

from __future__ import annotations

import os
import threading


class BusyClock:
    """Seconds the calling thread ran or wanted to run (on-CPU time + run-queue delay), from Linux's
    ``/proc/<pid>/task/<tid>/schedstat``.

    Why: in synchronous training every rank's *wall* step time is the same (the fast ones wait for the
    slowest in the collectives), so wall time cannot tell which node is slow. Busy time leaves out the
    time a thread sleeps in a collective or on I/O, and keeps the time it was runnable but had no CPU,
    which is where a throttled (cgroup quota) or oversubscribed node loses its time. ``read()`` returns
    None where schedstat is missing (not Linux, or a kernel without it): callers then use wall time.
    One ``pread`` of a kept file descriptor, about 2 us.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._tid = 0
        self._broken = False

    def read(self) -> float | None:
        if self._broken:
            return None
        tid = threading.get_native_id()
        if tid != self._tid or os.getpid() != getattr(self, "_pid", None):
            self._reopen(tid)
            if self._fd is None:
                return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return (int(fields[0]) + int(fields[1])) / 1e9
        except (OSError, ValueError, IndexError):
            self._broken = True
            return None

    def _reopen(self, tid: int) -> None:
        if self._fd is not None and getattr(self, "_pid", None) == os.getpid():
            os.close(self._fd)
        self._fd, self._tid, self._pid = None, tid, os.getpid()
        try:
            self._fd = os.open(f"/proc/{self._pid}/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._broken = True
