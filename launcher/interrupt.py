"""Waiting on an event so that Ctrl-C still ends the wait.

Why: Python runs signal handlers on the main thread only, but the kernel may deliver SIGINT to any of the
process's threads (the etcd client's, a watch's). The C-level handler then only sets a flag and writes the
wakeup fd; a main thread blocked in an untimed ``Event.wait()`` (a lock acquire) never wakes to look at the
flag, and ``erm events --follow`` ignored Ctrl-C for good. A timed wait returns every slice, and the
interpreter runs the pending handler (KeyboardInterrupt) when it does."""

from __future__ import annotations

import threading

SLICE_S = 0.25  # how late Ctrl-C may end the wait, at most


def wait_interruptibly(event: threading.Event) -> None:
    """Return once ``event`` is set; raise KeyboardInterrupt (within ``SLICE_S``) on Ctrl-C meanwhile."""
    while not event.wait(SLICE_S):
        pass
