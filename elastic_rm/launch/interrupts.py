"""Ctrl-C, SIGTERM and SIGHUP while `erm launch` runs: the first ends the run, a second hurries its end.

The first signal while the run starts or goes on raises KeyboardInterrupt, and erm launch stops the run's
nodes gracefully (their ermrun leaves the rendezvous; they are killed after --stop-grace). Once a stop
began, no signal raises any more: an exception in the middle of it would leave nodes running and the user
a traceback. A signal then only asks the stop to hurry (:attr:`Interrupts.hurry`): every node of the run
is stopped at once (``how``: a kill of each host's ermrun, or scancel), and erm launch returns once they
ended (bounded), naming any left. One more (:attr:`Interrupts.leave`) returns without waiting, naming the
nodes that may still run and how to stop them.
"""

from __future__ import annotations

import os
import signal

# SIGHUP: the session that started erm launch ended (an ssh connection to the login node dropped); the run
# ends as on Ctrl-C rather than leave its nodes running without a launcher. Unless it is ignored when erm
# launch starts (nohup): then it stays ignored, and the run goes on.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _write(line: str) -> None:
    """One line on stderr from a signal handler: os.write, which takes no lock the interrupted code holds."""
    try:
        os.write(2, f"erm launch: {line}\n".encode())
    except OSError:
        pass


class Interrupts:
    """The signal handlers of one `erm launch` (a context manager), and what they asked for. ``how``: what
    stopping a node at once means on this path, for the user's message."""

    def __init__(
        self,
        how: str = "scancel",
        first: str = "interrupted: stopping the run's nodes (Ctrl-C again stops them at once)",
    ) -> None:
        self.how = how
        self.first = first  # said on the first signal (before any node started, there is none to stop)
        self.stopping = False  # a stop began: signals hurry it instead of raising
        self.hurry = False  # a signal came during the stop: stop every node of the run at once
        self.leave = False  # one more: return without waiting for the nodes to end
        self._signals = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        for sig in SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup erm launch ...
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def stop(self) -> None:
        """A stop begins (an interrupt's, an error's, the run's end): from now on signals hurry it."""
        self.stopping = True

    def resume(self) -> bool:
        """The stop that began is over and the run goes on: True, and the next signal raises again; False
        when a signal came during that stop (the user asked erm launch to end)."""
        if self.hurry or self.leave:
            return False
        self.stopping = False
        return True

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if not self.stopping:
            self.stopping = True
            _write(self.first)
            raise KeyboardInterrupt
        if not self.hurry:
            self.hurry = True
            # the first signal, when erm launch began the stop by itself (the run's end, an error)
            said = "interrupted again" if self._signals > 1 else "interrupted"
            _write(
                f"{said}: stopping the run's nodes now ({self.how}), without waiting for their "
                "ermrun to leave the run (once more: return without waiting for them to end)"
            )
        elif not self.leave:
            self.leave = True
            said = "interrupted a third time" if self._signals > 2 else "interrupted again"
            _write(f"{said}: returning without waiting for the nodes to end")
