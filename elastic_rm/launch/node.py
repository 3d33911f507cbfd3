"""One node started by `erm launch`: the local ssh client, its log stream, and how to stop it."""

from __future__ import annotations

import collections
import subprocess
import threading
import time
from collections.abc import Callable

from ..proc import kill_tree
from .hostfile import Host

TAIL_LINES = 20  # output lines kept for failure reports
# the end of each such line kept: a failure's event carries its last lines twice (message, error), and
# the event log refuses an event past 16 KiB (elastic_rm.obs.events) with ValueError, which ended erm
# launch (a progress bar redrawn with \r and no newline is one long line)
TAIL_LINE_CHARS = 200  # 200 emoji are 2,400 bytes of JSON: 3 lines twice stay below 16 KiB


def _clip(line: str) -> str:
    return line if len(line) <= TAIL_LINE_CHARS else "..." + line[-TAIL_LINE_CHARS:]


class RemoteNode:
    """``ssh HOST <supervisor> ermrun ...`` as a local process in its own session (Ctrl-C on the launcher's
    terminal reaches the launcher only, which then stops every node in order). Its output is printed line
    by line with the host's name as prefix."""

    def __init__(self, host: Host, argv: list[str], print_line: Callable[[str], None]):
        self.host = host
        self.started_at = time.monotonic()
        self.stop_requested_at: float | None = None
        self.stop_reason = ""
        self.registered = False  # its node key appeared in etcd (the agent came up)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._print = print_line
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self._pump = threading.Thread(target=self._read, name=f"log-{host.name}", daemon=True)
        self._pump.start()

    @property
    def node_id(self) -> str:
        return self.host.node_id

    @property
    def stopping(self) -> bool:
        return self.stop_requested_at is not None

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail.append(_clip(line))
            self._print(f"[{self.host.name}] {line}")

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None:
            self._pump.join(timeout=2)  # the last lines belong to this exit's report
        return rc

    def tail(self, lines: int = 5) -> str:
        return "\n".join(list(self._tail)[-lines:])

    def _tell(self, line: str, close: bool) -> None:
        """A line to the host's supervisor (elastic_rm.launch.remote); ``close``: then the end of input."""
        stdin = self.popen.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(f"{line}\n".encode())
            stdin.flush()
        except OSError:
            pass  # the connection is gone already
        if close:
            try:
                stdin.close()
            except OSError:
                pass

    def request_stop(self, reason: str) -> None:
        """Ask the supervisor on the host to stop ermrun (it sends SIGTERM, then kills after its grace).
        The input stays open, for a kill_now."""
        if self.stop_requested_at is not None:
            return
        self.stop_requested_at = time.monotonic()
        self.stop_reason = reason
        self._tell("stop", close=False)

    def kill_now(self) -> None:
        """Ask the supervisor on the host to kill ermrun and its workers now (a hurried stop)."""
        self.stop_requested_at = self.stop_requested_at or time.monotonic()
        self._tell("kill", close=True)

    def kill(self) -> None:
        """The local ssh client and anything it started; the host's supervisor sees its input end and stops
        ermrun by itself."""
        kill_tree(self.pid)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
