"""The supervisor `erm launch` runs on each host: ``python -m elastic_rm.launch.remote [--grace S] -- ARGS``.

It runs ``ermrun ARGS`` and waits. When its standard input (the ssh channel) says ``stop`` or ends (the
launcher closed it, or the launcher or the connection died), it sends SIGTERM to ermrun, which stops its
workers and leaves the rendezvous without closing the run (torch's semantics for a signalled agent; the
others get a new round); after ``--grace`` seconds whatever is left of the tree is killed, or at once when
the input says ``kill`` (a second Ctrl-C on the launcher). It exits with ermrun's exit status, so the
launcher's ssh client reports it.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

from ..proc import kill_tree


def _watch_stdin(stop: threading.Event, kill: threading.Event) -> None:
    """A line ``stop`` or the end of input: the launcher wants this node gone; ``kill``: gone now."""
    try:
        for line in sys.stdin:
            word = line.strip()
            if word in ("stop", "kill"):
                stop.set()
            if word == "kill":
                kill.set()
                break
    except (OSError, ValueError):
        pass
    stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_rm.launch.remote")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("ermrun_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.ermrun_args[1:] if args.ermrun_args[:1] == ["--"] else args.ermrun_args
    stop, kill = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    agent = subprocess.Popen(
        [sys.executable, "-m", "launcher.ermrun", *rest], stdin=subprocess.DEVNULL, start_new_session=True
    )
    threading.Thread(target=_watch_stdin, args=(stop, kill), daemon=True).start()
    while agent.poll() is None and not stop.wait(0.2):
        pass
    if agent.poll() is None:
        print(f"[erm launch] stopping ermrun (pid {agent.pid}) on request", file=sys.stderr, flush=True)
        agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + args.grace
        while agent.poll() is None and time.monotonic() < deadline and not kill.wait(0.2):
            pass
        if agent.poll() is None:
            why = "on request" if kill.is_set() else f"after it ignored SIGTERM for {args.grace:g}s"
            print(f"[erm launch] killing ermrun and its workers {why}", file=sys.stderr, flush=True)
            kill_tree(agent.pid)
            return 128 + signal.SIGKILL  # kill_tree reaped it: Popen would read its status as 0
    rc = agent.wait()
    return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
