"""A process of simulated nodes (benchmarks/scale/nodes.py) as the scale benchmark drives it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

PY = sys.executable


class Child:
    """A nodes.py process and its JSON lines (read by a thread into a queue)."""

    def __init__(self, endpoint: str, jobs: str, start_file: str, log_dir: str, tag: str, profile: str = ""):
        argv = [
            PY,
            "-m",
            "benchmarks.scale.nodes",
            "--endpoint",
            endpoint,
            "--jobs",
            jobs,
            "--start-at-file",
            start_file,
        ]
        if profile:
            argv += ["--profile", os.path.join(profile, f"{tag}.json")]
        if os.environ.get("ERM_SCALE_LEASE_TTL"):  # set by benchmarks.scale --lease-ttl
            argv += ["--lease-ttl", os.environ["ERM_SCALE_LEASE_TTL"]]
        if os.environ.get("ERM_SCALE_CKPT_PORTS"):  # set by benchmarks.scale --ckpt-ports
            argv += ["--ckpt-ports"]
        self.tag = tag
        self.log = open(os.path.join(log_dir, f"{tag}.log"), "w")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.other: list[dict] = []  # lines that came while waiting for another kind
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass

    def expect(self, ev: str, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"no {ev!r} line from pid {self.proc.pid} within {timeout:.0f}s")
            item = self.lines.get(timeout=left)
            if item.get("ev") == ev:
                return item
            self.other.append(item)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
