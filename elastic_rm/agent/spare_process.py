"""One warm spare worker process, seen from the process that started it (:mod:`elastic_rm.agent.spare` is
the process itself).

It imports neither torch nor the agent, so that ``ermrun`` can start a node's spares first thing, before
its own imports: the spares then import torch while ermrun does, instead of after it
(:mod:`launcher.early_spares`; the agent's pool adopts them, :mod:`elastic_rm.agent.spares`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from . import spare as spare_main

log = logging.getLogger(__name__)

LOW_NICE = 19  # a spare warming next to training workers takes only idle CPU


class Spare:
    """One warm process: its ``Popen``, the starter's end of its socket, what it imports, the command it
    is labelled with, and whether it warms at low priority."""

    def __init__(self, modules: tuple[str, ...], low_priority: bool, label: tuple[str, ...] = ()) -> None:
        """``label``: the worker command it will run, only shown in its command line (ps, pgrep -f)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    spare_main.__file__,
                    str(theirs.fileno()),
                    str(LOW_NICE if low_priority else 0),
                    ",".join(modules),
                    *label,
                ],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # as torch starts workers: its killpg ends a spare's children too
            )
        finally:
            theirs.close()
        self.sock = ours
        self.modules = tuple(modules)
        self.label = tuple(label)
        self.low_priority = low_priority
        self.started = time.time()
        self._ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Its imports are done (it said so on the socket)."""
        if not self._ready:
            try:
                self._ready = self.sock.recv(1, socket.MSG_DONTWAIT) == spare_main.READY
            except BlockingIOError:
                pass
            except OSError:
                return False
        return self._ready

    def hand(self, argv: list[str], env: dict[str, str], stdout: Any, stderr: Any) -> None:
        """Its round: argv, environment, working directory and redirected stdout/stderr (their fds)."""
        fds = [f.fileno() for f in (stdout, stderr) if f is not None]
        message = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": stdout is not None}
        message["stderr"] = stderr is not None
        socket.send_fds(self.sock, [json.dumps(message).encode()], fds)
        self.sock.close()

    def kill(self) -> None:
        """Stop it by its pid (its process group: what it started too) and reap it."""
        self.sock.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("spare pid %d did not exit after SIGKILL", self.proc.pid)
