"""A cluster of ermrun nodes on this machine, for the demo, the closed-loop tests and the soak: each node
an `ermrun` process (agent and workers) training a script with its progress lines in the workdir.
Everything it starts is stopped by its process-group id, also on Ctrl-C or an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..proc import kill_tree, signal_tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
DEFAULT_SCRIPT = os.path.join(REPO, "examples", "dlrm", "train.py")
DEFAULT_JOB = os.path.join(REPO, "examples", "dlrm", "job.json")
BIN = os.path.dirname(sys.executable)  # where ermrun is installed beside this Python


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log: Any
    started: float
    killed: float | None = None

    def signal(self, sig: int) -> None:
        signal_tree(self.proc.pid, sig)  # the agent and its workers (they run in sessions of their own)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.proc.pid)  # workers left behind, if any
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@dataclass
class Demo:
    workdir: str
    script: str
    script_args: list[str]
    lease_ttl: int = 3  # seconds; 2 detects a dead node sooner but starves on a loaded machine
    nnodes: str = "2:3"
    agent_args: list[str] = field(default_factory=list)  # ermrun flags for every node (--job, ...)
    nodes: dict[str, Node] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: f"demo-{uuid.uuid4().hex[:6]}")

    @property
    def progress_dir(self) -> str:
        return os.path.join(self.workdir, "progress")

    def event(self, kind: str, text: str) -> None:
        self.events.append({"t": time.time(), "kind": kind, "text": text})

    def start_node(
        self,
        name: str,
        endpoint: str,
        extra: list[str] | None = None,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`prefix`: a command the node runs under (`ip netns exec NS` for a host of its own); `env`: more
        environment for it."""
        argv = [
            *(prefix or []),
            os.path.join(BIN, "ermrun"),
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            self.run_id,
            "--node-id",
            name,
            "--monitor-interval",
            "0.1",
            "--max-restarts",
            "3",
            "--rdzv-conf",
            f"lease_ttl={self.lease_ttl},last_call_timeout=1",
            *self.agent_args,
            *(extra or []),
            self.script,
            "--progress-dir",
            self.progress_dir,
            "--checkpoint-dir",
            os.path.join(self.workdir, "ckpt"),
            *self.script_args,
        ]
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        self.nodes[name] = Node(name, proc, log, time.time())
        self.event("node", f"node {name} started (pid {proc.pid})")

    def progress(self) -> list[dict]:
        if not os.path.isdir(self.progress_dir):
            return []
        return [
            row
            for fname in sorted(os.listdir(self.progress_dir))
            for row in jsonl_rows(os.path.join(self.progress_dir, fname))
        ]

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.remove_cgroups()

    def remove_cgroups(self) -> None:
        """The node cgroups (``--cpu-limit``) of agents that could not remove their own (SIGKILLed)."""
        from ..agent import cgroup as cg

        layout = cg.detect()
        if layout is not None:
            for name in self.nodes:
                group = cg.NodeCgroup(layout, f"{self.run_id}.{name}")
                if group.cpu_dir.exists() or group.memory_dir.exists():
                    group.remove()


def new_workdir() -> str:
    return tempfile.mkdtemp(prefix="erm-demo-")


def jsonl_rows(path: str) -> list[dict]:
    """The JSON lines of a progress file; a last line cut by SIGKILL is left out."""
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows
