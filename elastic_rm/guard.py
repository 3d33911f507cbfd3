"""A watchdog that ends the processes its owner started once the owner is gone, however it ended.

The owner (an `ermrun` agent for its workers, or whoever started an etcd server) keeps the write end of a
pipe; the watchdog, a small process in a session of its own, reads the pids (with their start times) the
owner sends. When the pipe reaches end-of-file (the owner exited, was killed by SIGKILL, or released it)
it kills every listed process that is still the same one, with its process group when it leads one (a
worker's data-loader children), then removes the temporary directories the owner listed (an agent's
channel directory, an embedded etcd's data), which an owner killed by SIGKILL cannot remove itself. The
watchdog imports nothing of elastic-rm and nothing heavy: it runs as ``python guard.py FD`` and starts in
milliseconds. The owner's side is :class:`Watchdog`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with the pid, an
    identity that a reused pid does not share."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


class Watchdog:
    """The owner's side: starts the watchdog on first use and tells it which pids to end with the owner."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._fd = -1

    def watch(self, pids: list[int], remove: list[str] = (), prune: list[str] = ()) -> None:
        """End ``pids`` with the owner; when it is gone, remove the files and directories in ``remove``,
        then the directories in ``prune`` that are empty by then (in the order given)."""
        self._start()
        lines = [f"{pid} {started}\n" for pid in pids if (started := start_time(pid)) is not None]
        lines += [f"rm {os.path.abspath(path)}\n" for path in remove]
        lines += [f"rmdir {os.path.abspath(path)}\n" for path in prune]
        if lines:
            os.write(self._fd, "".join(lines).encode())

    def _start(self) -> None:
        if self._proc is None:
            read_fd, self._fd = os.pipe()  # both ends non-inheritable: only the watchdog gets read_fd
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(read_fd)],
                    pass_fds=(read_fd,),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a signal to the owner's group must not end the watchdog first
                )
            finally:
                os.close(read_fd)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def release(self, keep_paths: bool = False) -> None:
        """The owner stopped what it started itself: the watchdog exits with nothing left to kill (it
        checks each pid's start time, so pids reused meanwhile are safe). It removes the listed
        directories unless ``keep_paths`` (an owner that keeps its data on purpose)."""
        if self._proc is not None:
            if keep_paths:
                os.write(self._fd, b"keep\n")
            os.close(self._fd)
            self._proc.wait(5)
            self._proc = None


def _end(pid: int) -> None:
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must not linger
        try:
            if group == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return


def _remove(verb: str, path: str) -> None:
    """Only what the owner named: a directory tree (never through a link) or a file; "rmdir": an empty
    directory only."""
    try:
        if verb == "rmdir":
            os.rmdir(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def main(fd: int) -> None:
    watched: dict[int, str] = {}
    paths: list[tuple[str, str]] = []
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(4096):  # ends at end-of-file: the owner is gone or done
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode()
                if text.startswith(("rm ", "rmdir ")):
                    verb, path = text.split(" ", 1)
                    paths.append((verb, path))
                elif text == "keep":
                    paths.clear()
                else:
                    pid, started = text.split()
                    watched[int(pid)] = started
    for pid, started in watched.items():
        if start_time(pid) == started:
            _end(pid)
    for verb, path in paths:
        _remove(verb, path)


if __name__ == "__main__":
    # A Ctrl-C to the owner's group, or a SIGTERM to the owner's whole tree, is the owner's to handle: the
    # watchdog ends when its owner does, and cleans up after it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    main(int(sys.argv[1]))
