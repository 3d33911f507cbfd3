"""A watchdog that stops the etcd servers a process started once that process is gone, however it ended.

The owner keeps the write end of a pipe; this process, started beside the servers in a session of its own,
reads the pids (with their start times) the owner sends. When the pipe reaches end-of-file (the owner
exited, was killed by SIGKILL, or stopped the servers itself and closed it), it kills every listed pid that
is still the same process. It imports nothing of elastic-rm and nothing heavy, so it starts in milliseconds.
Run as a script: ``python guard.py FD``.
"""

from __future__ import annotations

import os
import signal
import sys


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with the pid, an
    identity that a reused pid does not share."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def main(fd: int) -> None:
    watched: dict[int, str] = {}
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(4096):  # ends at end-of-file: the owner is gone or done
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                pid, started = line.decode().split()
                watched[int(pid)] = started
    for pid, started in watched.items():
        if start_time(pid) == started:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must not linger
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the owner's group is the owner's to handle
    main(int(sys.argv[1]))
