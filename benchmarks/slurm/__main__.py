"""Run the Slurm latency benchmark (see benchmarks/slurm/__init__.py): python -m benchmarks.slurm."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import fmt, stop_processes, summarize, write_result
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.obs.events import read_etcd
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import DemandRecord
from tests.slurm.cluster import SlurmCluster, why_not

REPO = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)
WORKER = "tests/launch/worker.py"
CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"
TARGET_UP_S, TARGET_RELEASE_S = 3.0, 2.0


def ermrun_flags(etcd, run_id: str, nnodes: str) -> list[str]:
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        "--monitor-interval",
        "0.1",
    ]


def records(work: Path, node: str) -> list[dict]:
    rows = []
    for path in sorted(work.glob(f"{node}-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def first_step_at(work: Path, world: int) -> tuple[str, float] | None:
    """The first step record at this world size, of any node: (node, time)."""
    best = None
    for path in work.glob("*.jsonl"):
        node = path.name.rsplit("-", 1)[0]
        for r in records(work, node):
            if r.get("world") == world and "step" in r and (best is None or r["t"] < best[1]):
                best = (node, r["t"])
    return best


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")


def run_events(etcd, run_id: str) -> list:
    with EtcdClient(etcd.endpoint) as client:
        events, _, _ = read_etcd(client, Keyspace("/elastic-rm", run_id))
    return events


def put_demand(etcd, run_id: str, n: int) -> float:
    now = time.time()
    rec = DemandRecord(target_nodes=n, reason="benchmark", leader="benchmark", time=now)
    with EtcdClient(etcd.endpoint) as client:
        client.put(Keyspace("/elastic-rm", run_id).demand, rec.to_json())
    return now


def scale_up(cluster, etcd, work: Path, grow_to: int, direct: bool) -> list[dict]:
    """Demand 1, then one more node at a time up to ``grow_to``; a row per step."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = {**cluster.env(), "STEPS_DIR": str(work), "STEPS_MAX": "0"}
    procs: list[subprocess.Popen] = []
    log = open(work / "launch.log", "wb")
    put_demand(etcd, run_id, 1)

    def start_direct(k: int) -> None:
        argv = [
            os.path.join(BIN, "ermrun"),
            *ermrun_flags(etcd, run_id, f"1:{grow_to}"),
            "--node-id",
            f"d{k}",
            WORKER,
        ]
        procs.append(
            subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    if direct:
        start_direct(1)
    else:
        argv = [
            os.path.join(BIN, "erm"),
            "launch",
            "--slurm",
            "--slurm-output",
            str(work / "%x-%j.out"),
            "--env",
            f"STEPS_DIR={work}",
            "--env",
            "STEPS_MAX=0",
            "--workdir",
            str(REPO),
            "--poll-interval",
            "0.2",
            "--stop-grace",
            "15",
            *ermrun_flags(etcd, run_id, f"1:{grow_to}"),
            WORKER,
        ]
        procs.append(
            subprocess.Popen(
                argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    rows = []
    try:
        wait(lambda: first_step_at(work, 1), 120, "the first node training")
        for k in range(2, grow_to + 1):
            time.sleep(2)  # a few steps at the old size
            t0 = put_demand(etcd, run_id, k)
            if direct:
                start_direct(k)
            node, t_train = wait(lambda k=k: first_step_at(work, k), 120, f"{k} nodes training")
            rows.append(breakdown(etcd, run_id, work, k, t0, t_train, direct))
            print(f"  {'direct' if direct else 'slurm'} {k - 1}->{k}: {fmt(rows[-1]['total_s'])}", flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT if not direct else signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                pass
        stop_processes(procs)
        log.close()
    return rows


def breakdown(etcd, run_id: str, work: Path, k: int, t0: float, t_train: float, direct: bool) -> dict:
    events = run_events(etcd, run_id)
    launch = [e for e in events if e.kind == "launch" and e.time >= t0]
    submit = next((e.time for e in launch if e.data.get("action") == "submit"), None)
    running = next((e for e in launch if e.data.get("action") == "running"), None)
    node = running.data["host"] if running else f"d{k}"
    agent = min((e.time for e in events if e.node == node and e.time >= t0), default=None)
    row = {"to_world": k, "node": node, "total_s": t_train - t0, "ermrun_up_to_training_s": None}
    if agent is not None:
        row["ermrun_up_to_training_s"] = t_train - agent
        row.update(node_start(events, node, agent, t_train))
    process = process_started(events, node, t0)  # ermrun's process (the batch script exec's it)
    if process is not None and agent is not None:
        row["process_to_ermrun_up_s"] = agent - process  # its imports and the agent's set-up
    if not direct and submit is not None and running is not None and agent is not None:
        row.update(
            decision_to_submit_s=submit - t0,
            submit_to_running_s=running.time - submit,
            decision_to_running_s=running.time - t0,
            running_to_ermrun_up_s=agent - running.time,
        )
        if process is not None:  # "running" is the launcher's squeue poll; this is the process itself
            row["submit_to_process_s"] = process - submit
    elif agent is not None:
        row["start_to_ermrun_up_s"] = agent - t0
        if process is not None:
            row["start_to_process_s"] = process - t0
    return row


def process_started(events: list, node: str, t0: float) -> float | None:
    """When the node's ermrun process started, from its first event (the agent's "started")."""
    started = next(
        (e for e in events if e.node == node and e.data.get("status") == "started" and e.time >= t0), None
    )
    return started.data.get("process_started") if started is not None else None


def node_start(events: list, node: str, agent: float, t_train: float) -> dict:
    """The new node's own start, from its events: ermrun up -> its warm spare workers ready (the agent
    joins the rendezvous then; the running job trains meanwhile) -> the leader's round with it -> its
    first step."""
    warm_event = next(
        (e for e in events if e.node == node and "spares_warm" in e.data and e.time >= agent), None
    )
    if warm_event is None:
        return {}
    warm = warm_event.time
    decided = next(
        (
            e.time
            for e in events
            if e.kind == "decision" and e.time >= warm and node in e.data.get("members", ())
        ),
        None,
    )
    out = {
        "ermrun_up_to_spares_warm_s": warm - agent,
        "spares_started_early": len(warm_event.data.get("early_pids", ())),
    }
    if decided is not None:
        out.update(spares_warm_to_round_s=decided - warm, round_to_training_s=t_train - decided)
    return out


def release(cluster, etcd, work: Path) -> list[dict]:
    """4 node jobs, the planner wants 2: a row per released node."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    job = json.loads((REPO / "examples" / "emulated" / "job.json").read_text())
    job["name"] = run_id
    del job["request"]  # the launcher then starts MAX (4) node jobs; the planner's cold start wants 2
    job["planner"]["cold_start_nodes"] = 2
    (work / "job.json").write_text(json.dumps(job))
    argv = [
        os.path.join(BIN, "erm"),
        "launch",
        "--slurm",
        "--slurm-output",
        str(work / "%x-%j.out"),
        "--workdir",
        str(REPO),
        "--poll-interval",
        "0.2",
        "--stop-grace",
        "15",
        "--job",
        str(work / "job.json"),
        *ermrun_flags(etcd, run_id, "2:4"),
        "examples/emulated/train.py",
        "--samples",
        "1000000000",
        "--step-s",
        "0.2",
        "--state",
        str(work / "state"),
    ]
    log = open(work / "launch.log", "wb")
    p = subprocess.Popen(
        argv, env=cluster.env(), cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    idle_at: dict[str, float] = {}
    try:

        def stops():
            return [e for e in run_events(etcd, run_id) if e.data.get("action") == "stop"]

        stopped = wait(lambda: len(stops()) == 2 and stops(), 180, "2 node jobs released")
        hosts = [e.data["host"] for e in stopped]

        def all_idle():
            states = cluster.node_states()
            for h in hosts:
                if h not in idle_at and states.get(h) == "idle":
                    idle_at[h] = time.time()
            return len(idle_at) == len(hosts)

        wait(all_idle, 60, "the released nodes idle in sinfo")

        def ended():
            events = run_events(etcd, run_id)
            return len([e for e in events if e.data.get("action") == "stopped"]) == len(hosts) and events

        events = wait(ended, 60, "the launcher's stopped events")
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            pass
        stop_processes([p])
        log.close()
    rows = []
    for stop in stopped:
        host = stop.data["host"]
        ended = next(
            e.time for e in events if e.data.get("action") == "stopped" and e.data.get("host") == host
        )
        rows.append(
            {"node": host, "total_s": idle_at[host] - stop.time, "stop_to_job_ended_s": ended - stop.time}
        )
        print(f"  release {host}: {fmt(rows[-1]['total_s'])}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=8, help="slurmd of the local cluster (default 8)")
    ap.add_argument("--grow-to", type=int, default=5, help="scale-ups from 1 node to this many (default 5)")
    ap.add_argument("--release-runs", type=int, default=2, help="runs of the release part (2 nodes each)")
    ap.add_argument("--name", default="slurm", help="results file benchmarks/results/<name>.json")
    args = ap.parse_args()
    reason = why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="erm-bench-slurm-"))
    try:
        t_up = time.monotonic()
        with EtcdServer() as etcd, SlurmCluster(args.nodes) as cluster:
            up_s = time.monotonic() - t_up
            parts = {}
            for name, direct in (("slurm", False), ("direct", True)):
                work = root / f"up-{name}"
                work.mkdir()
                parts[name] = scale_up(cluster, etcd, work, args.grow_to, direct)
                cluster.reset()
            releases = []
            for i in range(args.release_runs):
                work = root / f"release-{i}"
                work.mkdir()
                releases += release(cluster, etcd, work)
                cluster.reset()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    start = (
        "ermrun_up_to_training_s",
        "ermrun_up_to_spares_warm_s",
        "spares_warm_to_round_s",
        "round_to_training_s",
    )
    keys = (
        "total_s",
        "decision_to_submit_s",
        "submit_to_running_s",
        "decision_to_running_s",
        "running_to_ermrun_up_s",
        "submit_to_process_s",
        "process_to_ermrun_up_s",
        *start,
    )
    up = {k: summarize([r[k] for r in parts["slurm"] if r.get(k) is not None]) for k in keys}
    direct = {
        k: summarize([r[k] for r in parts["direct"] if r.get(k) is not None])
        for k in ("total_s", "start_to_ermrun_up_s", "start_to_process_s", "process_to_ermrun_up_s", *start)
    }
    rel = {k: summarize([r[k] for r in releases]) for k in ("total_s", "stop_to_job_ended_s")}
    ratio = up["total_s"]["median"] / direct["total_s"]["median"]
    result = {
        "config": {
            "nodes": args.nodes,
            "grow_to": args.grow_to,
            "release_runs": args.release_runs,
            "cluster_up_s": up_s,
            "targets_s": {"scale_up": TARGET_UP_S, "release": TARGET_RELEASE_S},
        },
        "scale_up": {**up, "rows": parts["slurm"], "meets_target": up["total_s"]["median"] <= TARGET_UP_S},
        "scale_up_direct": {**direct, "rows": parts["direct"]},
        "scale_up_ratio_vs_direct": ratio,
        "release": {**rel, "rows": releases, "meets_target": rel["total_s"]["median"] <= TARGET_RELEASE_S},
        "load_avg_after": list(os.getloadavg()),
    }
    print(
        f"scale-up median {fmt(up['total_s']['median'])} (target {TARGET_UP_S:g} s), direct ermrun "
        f"{fmt(direct['total_s']['median'])}: ratio {ratio:.2f}x; "
        f"release median {fmt(rel['total_s']['median'])} "
        f"(target {TARGET_RELEASE_S:g} s)"
    )
    print("wrote", write_result(args.name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
