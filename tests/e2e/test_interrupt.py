"""Ctrl-C ends `erm events --follow` and `erm top` even when the kernel hands SIGINT to a thread other than
the main one (launcher/interrupt.py). A real process, a real signal: a helper thread sends SIGINT to itself
(``pthread_kill``), so the C-level handler runs there, not on the main thread."""

from __future__ import annotations

import subprocess
import sys
import time

CHILD = """
import signal, sys, threading, time
from launcher.interrupt import wait_interruptibly

def signal_this_thread():
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    time.sleep(60)

threading.Thread(target=signal_this_thread, daemon=True).start()
print("waiting", flush=True)
try:
    if sys.argv[1] == "sliced":
        wait_interruptibly(threading.Event())
    else:
        threading.Event().wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _child(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "waiting"
    return proc


def test_a_sigint_delivered_to_another_thread_ends_the_wait():
    proc = _child("sliced")
    try:
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "interrupted", (proc.returncode, out)


def test_the_untimed_wait_it_replaces_misses_that_sigint():
    """The control: the same signal leaves an untimed wait blocked (the CI hang this fixes)."""
    proc = _child("untimed")
    try:
        time.sleep(3)
        assert proc.poll() is None, "the untimed wait woke up: the test no longer shows the hazard"
    finally:
        proc.kill()
        proc.wait(10)
