"""Checkpoint servers for simulated nodes on one machine (tests, benchmarks): one real process per node
(``python -m elastic_rm.checkpoint.local_servers``, the stand-alone server: :func:`main`), each serving
only its node's memory directory, on loopback; and the peer lists an agent would hand to each node's
workers (ELASTIC_RM_CKPT_PEERS). Under ermrun each node's agent runs its own server instead."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server import CheckpointServer

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV = "ELASTIC_RM_CKPT_TOKEN"  # the server's token (never on the command line, where `ps` shows it)


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
            env = {**os.environ, "PYTHONPATH": str(REPO), TOKEN_ENV: token}
            cmd = [
                sys.executable,
                "-m",
                "elastic_rm.checkpoint.local_servers",
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


def main(argv: list[str] | None = None) -> None:
    """One stand-alone server until SIGTERM or SIGINT; the bound port is written to --port-file."""
    ap = argparse.ArgumentParser(description="Serve one node's flash-checkpoint memory directory.")
    ap.add_argument("--dir", required=True, type=Path, help="the node's memory directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    args = ap.parse_args(argv)
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"set {TOKEN_ENV} to the bearer token peers will use")
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with CheckpointServer(args.dir, args.host, args.port, token) as server:
        if args.port_file:
            tmp = args.port_file.with_name(args.port_file.name + ".tmp")
            tmp.write_text(str(server.port))
            tmp.replace(args.port_file)
        while not stop.wait(1.0):
            pass


if __name__ == "__main__":
    main()
