"""Shared fixtures: a real etcd per test session, real processes stopped by their ids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from elastic_rm.etcd.server import EtcdCluster, EtcdServer
from elastic_rm.proc import kill_tree, signal_tree
from tests.hang_guard import (  # noqa: F401 - the hooks of a plugin, found here by name
    pytest_addoption,
    pytest_configure,
    pytest_timeout_cancel_timer,
    pytest_timeout_set_timer,
)
from tests.leftovers import SessionMarks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

# A suite started in the background (`make test &`, nohup, a non-interactive shell's job) inherits SIGINT
# ignored, and every process it starts would too: Python then installs no KeyboardInterrupt handler, and a
# test that stops `erm top` with Ctrl-C's signal waits for nothing. Tests start their processes as from a
# terminal: with Python's own handler here, a child execs with SIGINT at its default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def no_leftovers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session fails (at its last teardown) when it left a process, a temporary directory or node
    memory behind, naming each; they are removed either way (tests/leftovers.py)."""
    tmp_path_factory.getbasetemp()  # pytest's own tmp_path stays where it was
    marks = SessionMarks()
    marks.enter()
    yield
    leftovers = marks.exit()
    if leftovers:
        pytest.fail("the test session left these behind (now removed):\n  " + "\n  ".join(leftovers))


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdCluster]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


class Proc:
    """A process in its own session, so that the whole tree is stopped by its id."""

    def __init__(
        self, argv: list[str], log_path: str, env: dict[str, str] | None = None, cwd: str | None = None
    ):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, **(env or {})}
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd or REPO,
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def signal(self, sig: int) -> None:
        """To the whole tree: torch starts workers in sessions of their own, out of the agent's group."""
        signal_tree(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.pid)  # the agent may be gone while workers linger
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()
