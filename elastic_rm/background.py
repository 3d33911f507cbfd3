"""A daemon thread that runs a loop until told to stop, and an HTTP server served on one.

Why one helper: the long-lived threads of a node (the metrics endpoint, the checkpoint server, the worker
channel, the resource monitor, the agent's metrics publisher, the round leader, ermrun's status line) all
start once, stop with a bounded wait, and must never keep the process alive. Written once here, every one
starts and stops the same way. Stdlib only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2  # how long an HTTP server takes at most to notice a stop


class Background:
    """Runs ``loop(stop)`` on a named daemon thread until ``stop`` (a ``threading.Event``) is set.

    ``start()`` once (again after ``stop()``); ``stop()`` sets the event, calls ``wake`` (for a loop
    that blocks elsewhere than on the event), and waits at most ``timeout_s`` for the thread to end.
    """

    def __init__(
        self, loop: Callable[[threading.Event], None], name: str, wake: Callable[[], None] | None = None
    ) -> None:
        self.name = name
        self.stopping = threading.Event()
        self._loop = loop
        self._wake = wake
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started; call stop() first")
        self.stopping.clear()
        self._thread = threading.Thread(target=self._loop, args=(self.stopping,), name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop and wait; False (and a warning) when the thread is still running after ``timeout_s``."""
        self.stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        if self._wake is not None:
            self._wake()
        if thread is threading.current_thread():  # stopped from its own loop: it ends when it returns
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("thread %s did not stop within %.1f s", self.name, timeout_s)
            return False
        return True


class HttpThread:
    """Serves ``server`` on a daemon thread from construction on (request threads are daemons too);
    ``stop()`` ends serving and frees the port."""

    def __init__(self, server: ThreadingHTTPServer, name: str) -> None:
        self.server = server
        server.daemon_threads = True
        self._thread = Background(
            lambda _stopping: server.serve_forever(poll_interval=POLL_INTERVAL_S), name, wake=server.shutdown
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self, timeout_s: float) -> None:
        self._thread.stop(timeout_s)  # shutdown() returns once serve_forever has left its loop
        self.server.server_close()
