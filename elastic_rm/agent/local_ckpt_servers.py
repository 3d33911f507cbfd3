"""Checkpoint servers for simulated nodes on one machine (tests, benchmarks): one real process per node
(python -m elastic_rm.agent.ckpt_server), each serving only its node's memory directory, on loopback; and
the peer lists an agent would hand to each node's workers (ELASTIC_RM_CKPT_PEERS). Under ermrun each
node's agent runs its own server instead."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class NodeServer:
    node: str
    proc: subprocess.Popen
    port: int
    token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def peer(self) -> dict[str, str]:
        return {"node": self.node, "url": self.url, "token": self.token}


@contextmanager
def node_servers(root: Path, nodes: list[str], timeout: float = 60.0) -> Iterator[dict[str, NodeServer]]:
    """Start one server process per node (serving root/<node>); all are killed by pid at the end."""
    started: dict[str, NodeServer] = {}
    procs: dict[str, tuple[subprocess.Popen, str, Path]] = {}
    try:
        for node in nodes:
            token = secrets.token_urlsafe(16)
            port_file = root / f".port-{node}"
            port_file.unlink(missing_ok=True)
            root.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONPATH": str(REPO), "ELASTIC_RM_CKPT_TOKEN": token}
            cmd = [
                sys.executable,
                "-m",
                "elastic_rm.agent.ckpt_server",
                "--dir",
                str(root / node),
                "--port-file",
                str(port_file),
            ]
            procs[node] = (subprocess.Popen(cmd, env=env, cwd=REPO), token, port_file)
        deadline = time.monotonic() + timeout
        for node, (proc, token, port_file) in procs.items():
            while not port_file.exists():
                assert proc.poll() is None, f"checkpoint server of {node} exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"checkpoint server of {node} did not start in {timeout}s"
                time.sleep(0.05)
            started[node] = NodeServer(node, proc, int(port_file.read_text()), token)
        yield started
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def peer_lists(servers: dict[str, NodeServer], members: list[str]) -> dict[str, Any]:
    """For each member: the other members' servers, as the agent's ELASTIC_RM_CKPT_PEERS value."""
    return {
        node: {"v": 1, "peers": [servers[m].peer() for m in members if m != node and m in servers]}
        for node in members
    }
