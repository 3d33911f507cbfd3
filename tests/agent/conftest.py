"""Fixtures for the agent tests: real subprocesses that are always killed, free ports, agent channels."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class Procs:
    """Starts Python subprocesses (no ELASTIC_RM_AGENT_DIR unless given) and kills leftovers at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def python(self, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[bytes]:
        full_env = {k: v for k, v in os.environ.items() if k != "ELASTIC_RM_AGENT_DIR"}
        full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
        full_env.update(env or {})
        proc = subprocess.Popen([sys.executable, *args], env=full_env, **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def pyprocs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def step_worker() -> str:
    return str(HERE / "step_worker.py")
