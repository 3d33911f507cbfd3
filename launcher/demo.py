"""`erm demo`: a whole elastic job on this machine, with a live view and a summary at the end.

Scenario: an embedded etcd; two node agents (`ermrun`) training the example DLRM at world 2; a third
node arrives (scale-up round, world 3); one node is killed with SIGKILL (its lease expires, the survivors
get a round of 2 and restore from the flash checkpoint); the job is stopped. Everything it starts is
stopped by its process-group id, also on Ctrl-C or an error.
"""

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

from elastic_rm.proc import kill_tree, signal_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SCRIPT = os.path.join(REPO, "examples", "dlrm", "train.py")
DEFAULT_JOB = os.path.join(REPO, "examples", "dlrm", "job.json")
BIN = os.path.dirname(sys.executable)


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

    def start_node(self, name: str, endpoint: str, extra: list[str] | None = None) -> None:
        argv = [
            os.path.join(BIN, "ermrun"), "--nnodes", self.nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-id", self.run_id, "--node-id", name, "--monitor-interval", "0.1", "--max-restarts", "3",
            "--rdzv-conf", f"lease_ttl={self.lease_ttl},last_call_timeout=1", *self.agent_args, *(extra or []),
            self.script, "--progress-dir", self.progress_dir, "--checkpoint-dir", os.path.join(self.workdir, "ckpt"),
            *self.script_args,
        ]  # fmt: skip
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.nodes[name] = Node(name, proc, log, time.time())
        self.event("node", f"node {name} started (pid {proc.pid})")

    def progress(self) -> list[dict]:
        rows: list[dict] = []
        if not os.path.isdir(self.progress_dir):
            return rows
        for fname in sorted(os.listdir(self.progress_dir)):
            with open(os.path.join(self.progress_dir, fname)) as fh:
                for line in fh:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by SIGKILL
        return rows

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.remove_cgroups()

    def remove_cgroups(self) -> None:
        """The node cgroups (``--cpu-limit``) of agents that could not remove their own (SIGKILLed)."""
        from elastic_rm.agent import cgroup as cg

        layout = cg.detect()
        if layout is not None:
            for name in self.nodes:
                group = cg.NodeCgroup(layout, f"{self.run_id}.{name}")
                if group.cpu_dir.exists() or group.memory_dir.exists():
                    group.remove()


def restarted_at(rows: list[dict], world: int, since: float, min_steps: int = 3) -> bool:
    """Rank 0's workers started anew at ``world`` after ``since`` and trained ``min_steps`` steps."""
    starts = [
        r["t"]
        for r in rows
        if r.get("start") and r.get("rank") == 0 and r["world"] == world and r["t"] >= since
    ]
    return bool(starts) and world_reached(rows, world, starts[-1], min_steps)


def world_reached(rows: list[dict], world: int, since: float, min_steps: int = 3) -> bool:
    steps = [r for r in rows if r.get("world") == world and r["t"] >= since and "step" in r]
    return len({r["step"] for r in steps}) >= min_steps


def new_workdir() -> str:
    return tempfile.mkdtemp(prefix="erm-demo-")


def rounds_from_etcd(endpoint: str, run_id: str) -> list[dict]:
    """The sealed rounds of the run, as recorded by the leader under rounds/<n>/record."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace
    from elastic_rm.wire.records import effective_rounds

    keys = Keyspace(DEFAULT_PREFIX, run_id)
    errors: list[str] = []
    with EtcdClient(endpoint, timeout=5) as client:
        kvs, _ = client.get_prefix(keys.rounds)
    out = [
        {"round": r.round, "members": list(r.members), "reason": r.reason, "t": r.time}
        for r in effective_rounds(kvs, errors)
    ]
    return out + [{"round": None, "error": e} for e in errors]


def outcomes_from_etcd(endpoint: str, run_id: str) -> dict[int, dict]:
    """Round -> the leader's measured outcome of it (throughput before/after, measured and predicted gain)."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.obs.events import read_etcd
    from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace

    with EtcdClient(endpoint, timeout=5) as client:
        found, _errors, _ = read_etcd(client, Keyspace(DEFAULT_PREFIX, run_id))
    return {
        e.data["round"]: e.data for e in found if e.kind == "outcome" and isinstance(e.data.get("round"), int)
    }


def decisions_from_etcd(endpoint: str, run_id: str) -> list[dict]:
    """The leader's decisions from the run's event log: round, members, reason, unix time."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.obs.events import read_etcd
    from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace

    with EtcdClient(endpoint, timeout=5) as client:
        found, _errors, _ = read_etcd(client, Keyspace(DEFAULT_PREFIX, run_id))
    return [
        {
            "round": e.data.get("round"),
            "members": e.data.get("members", []),
            "reason": e.data.get("reason", ""),
            "t": e.time,
        }
        for e in found
        if e.kind == "decision"
    ]


def checks(rows: list[dict]) -> list[dict]:
    """What the model state went through, checked from rank 0's progress lines at every restart:
    a planned round restores exactly the drained state (same step; same checksum of the embeddings,
    the optimizer states and the dense weights) and every restart continues at the step after the
    restored one, each step once; and, by sample identity from the ledger's ranges, each global batch
    follows the one before it, so no sample is lost or doubled in the model."""
    rank0 = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: r["t"])
    starts = [i for i, r in enumerate(rank0) if r.get("start")]
    out = []
    for n, i in enumerate(starts[1:], 1):
        start = rank0[i]
        before = rank0[starts[n - 1] : i]
        restored = start.get("restored_step")
        drained = [r for r in before if "drained_step" in r]
        last = max((r["step"] for r in before if "step" in r), default=0)
        nxt = starts[n + 1] if n + 1 < len(starts) else len(rank0)
        after = [r["step"] for r in rank0[i:nxt] if "step" in r]
        label = f"restart at world {start['world']}"
        if drained and drained[-1]["drained_step"] == restored:
            same = drained[-1]["checksum"] == start["checksum"]
            out.append({
                "what": f"{label}: state as drained",
                "ok": same,
                "detail": f"step {restored}, checksum {start['checksum']} (drained {drained[-1]['checksum']})",
            })  # fmt: skip
        else:
            out.append({
                "what": f"{label}: restored the last checkpoint",
                "ok": restored is not None and restored <= last,
                "detail": f"step {restored} of {last} trained before the fault; steps after it are trained again",
            })  # fmt: skip
        consecutive = bool(after) and after == list(
            range((restored or 0) + 1, (restored or 0) + 1 + len(after))
        )
        out.append({
            "what": f"{label}: every step (sample range) once",
            "ok": consecutive,
            "detail": f"steps {after[0] if after else '-'}..{after[-1] if after else '-'} follow step {restored}",
        })  # fmt: skip
        if any("sample_start" in r for r in rank0[i:nxt]):
            out.append(_ledger_check(label, rank0[:i], rank0[i:nxt], restored))
    ends = [r for r in rank0 if r.get("end") and "ledger_samples_done" in r]
    if ends:
        end = ends[-1]
        batch = next((r["samples"] * r["world"] for r in reversed(rank0) if "samples" in r), 0)
        out.append({
            "what": "the ledger counts every trained sample once",
            "ok": end["ledger_samples_done"] == end["final_step"] * batch,
            "detail": f"{end['ledger_samples_done']} samples done = {end['final_step']} steps x {batch}",
        })  # fmt: skip
    return out


def _next_sample(row: dict) -> tuple[int, int]:
    """(epoch, first sample) of the global batch after `row`'s."""
    return row["epoch"], row["sample_end"]


def _ledger_check(label: str, before: list[dict], after: list[dict], restored: int | None) -> dict:
    """By sample identity, from the ledger's ranges: the first batch after a restore is the one after the
    restored step's batch (a fresh start: sample 0), and each later batch follows the one before."""
    steps = [r for r in after if "sample_start" in r]
    prior = [r for r in before if r.get("step") == restored and "sample_end" in r] if restored else []
    expect = _next_sample(prior[-1]) if prior else (0, 0)
    bad = []
    for r in steps:
        if (r["epoch"], r["sample_start"]) != expect and (r["epoch"], r["sample_start"]) != (
            expect[0] + 1,
            0,
        ):
            bad.append(
                f"step {r['step']}: samples from {r['sample_start']} (epoch {r['epoch']}), expected {expect[1]}"
            )
        expect = _next_sample(r)
    first = steps[0]["sample_start"] if steps else "-"
    return {
        "what": f"{label}: every sample once (ledger)",
        "ok": bool(steps) and not bad,
        "detail": bad[0] if bad else f"samples from {first} follow step {restored}'s batch, none skipped or repeated",
    }  # fmt: skip


def lineage(rows: list[dict]) -> list[tuple[int, int, int]]:
    """The world-size schedule of the final model: (world, first step, last step) of each stretch of
    steps whose effect the final state holds, oldest first. Steps trained after the checkpoint a restart
    restored from were lost with the fault and are not in it. From rank 0's progress lines."""
    rank0 = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: r["t"])
    starts = [i for i, r in enumerate(rank0) if r.get("start")]
    runs = []  # (world, restored step, last step trained) per worker start
    for n, i in enumerate(starts):
        nxt = starts[n + 1] if n + 1 < len(starts) else len(rank0)
        trained = [r["step"] for r in rank0[i:nxt] if "step" in r]
        restored = rank0[i].get("restored_step") or 0
        runs.append((rank0[i]["world"], restored, max(trained, default=restored)))
    out: list[tuple[int, int, int]] = []
    ends = [r["final_step"] for r in rank0 if r.get("end")]
    upto = ends[-1] if ends else (runs[-1][2] if runs else 0)  # walk back from the final state
    for world, restored, last in reversed(runs):
        if restored < upto <= last:  # this run produced steps restored+1..upto of the lineage
            out.append((world, restored + 1, upto))
            upto = restored
    return out[::-1]


def segments(rank0: list[dict], gap_s: float = 2.0) -> list[list[dict]]:
    """Rank 0's step lines split where the world changes or training paused (a restart)."""
    out: list[list[dict]] = []
    for r in rank0:
        if out and r["world"] == out[-1][-1]["world"] and r["t"] - out[-1][-1]["t"] <= gap_s:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def summarize(rows: list[dict], rounds: list[dict]) -> dict:
    """Throughput per world size (all ranks' samples over the time spent training at that size),
    downtime per change (rank 0's last step before -> first step after), and the restores."""
    steps = [r for r in rows if "step" in r]
    rank0 = sorted((r for r in steps if r.get("rank") == 0), key=lambda r: r["t"])
    segs = segments(rank0)
    busy: dict[int, float] = {}
    samples: dict[int, int] = {}
    for seg in segs:
        world, lo, hi = seg[0]["world"], seg[0]["t"], seg[-1]["t"]
        busy[world] = busy.get(world, 0.0) + (hi - lo)
        samples[world] = samples.get(world, 0) + sum(
            r.get("samples", 0) for r in steps if r["world"] == world and lo < r["t"] <= hi
        )
    throughput = {w: samples[w] / busy[w] for w in sorted(busy) if busy[w] > 0}
    downtime = [
        {"from": a[-1]["world"], "to": b[0]["world"], "seconds": b[0]["t"] - a[-1]["t"]}
        for a, b in zip(segs, segs[1:], strict=False)
    ]
    restores = [r for r in rows if r.get("restored_step") is not None and r.get("rank") == 0]
    return {"throughput": throughput, "downtime": downtime, "rounds": rounds, "restores": restores}
