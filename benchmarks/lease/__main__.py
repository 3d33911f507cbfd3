"""Lease benchmark: how short a lease TTL stays free of false expiry under load.

Recovery after a lost node is bounded by the lease TTL (the survivors' new round waits for the dead
node's key to expire), so a short TTL recovers sooner, and a TTL shorter than the worst stall of a live
agent's keep-alive thread expels healthy nodes. For each TTL this runs the soak's job (three `ermrun`
nodes training examples/dlrm/train.py, paced) for a while with no fault, optionally beside CPU burners
(``--burners``: busy processes, like a test suite beside the job), and counts false expiries: rounds that
lost a member, and nodes that found their lease gone and rejoined, from the run's event log in etcd. The
machine's load average is sampled through the run. Writes benchmarks/results/lease.json.

Run: ``python -m benchmarks.lease --ttls 1 2 3 --seconds 120 --burners 1``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import end_run, write_result
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.obs import events as ev
from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "dlrm" / "train.py"
BIN = Path(sys.executable).parent
BURN = "import time\nwhile True:\n    time.perf_counter()\n"


def start_node(workdir: Path, endpoint: str, run_id: str, i: int, ttl: int, pace: float) -> subprocess.Popen:
    argv = [
        str(BIN / "ermrun"),
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--node-id",
        f"n{i}",
        "--monitor-interval",
        "0.1",
        "--max-restarts",
        "3",
        "--rdzv-conf",
        f"lease_ttl={ttl},last_call_timeout=1",
        str(SCRIPT),
        "--progress-dir",
        str(workdir / "progress"),
        "--checkpoint-every",
        "20",
        "--pace",
        str(pace),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(workdir / f"n{i}.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def count_false_expiries(endpoint: str, run_id: str) -> dict:
    with EtcdClient(endpoint, timeout=5) as c:
        found, errors, _ = ev.read_etcd(c, Keyspace(DEFAULT_PREFIX, run_id))
    lost = [e.message for e in found if e.kind == "decision" and "lost" in e.message]
    rejoined = [e.message for e in found if e.kind == "node" and "expired" in e.message]
    rounds = [e for e in found if e.kind == "decision"]
    return {"lost_rounds": lost, "rejoined": rejoined, "decisions": len(rounds), "event_errors": len(errors)}


def _steps_at_world(progress: Path, world: int) -> int:
    steps = 0
    for path in progress.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if '"step"' in line and f'"world": {world}' in line and '"rank": 0' in line:
                steps += 1
    return steps


def trial(ttl: int, seconds: float, burners: int, pace: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"erm-lease-{ttl}-"))
    run_id = f"lease-{uuid.uuid4().hex[:8]}"
    etcd = EtcdServer().start()
    procs: list[subprocess.Popen] = []
    burn: list[subprocess.Popen] = []
    try:
        procs = [start_node(workdir, etcd.endpoint, run_id, i, ttl, pace) for i in range(3)]
        time.sleep(20)  # start-up: the three workers import torch and build the model
        burn = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
        loads, t0 = [], time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(5)
            loads.append(os.getloadavg()[0])
            if any(p.poll() is not None for p in procs):
                break
        result = count_false_expiries(etcd.endpoint, run_id)
        steps = _steps_at_world(workdir / "progress", 3)
        return {
            "ttl": ttl,
            "seconds": round(time.monotonic() - t0, 1),
            "burners": burners,
            "false_expiries": len(result["lost_rounds"]) + len(result["rejoined"]),
            **result,
            "load_avg_1m_mean": round(sum(loads) / len(loads), 2) if loads else None,
            "load_avg_1m_max": max(loads) if loads else None,
            "agents_exited": [p.poll() for p in procs],
            "steps_at_world_3": steps,  # rank 0's: the job trained throughout, at full size
        }
    finally:
        for p in burn:
            p.kill()  # by pid: the burners this trial started
            p.wait(10)
        end_run(procs, etcd, run_id, workdir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttls", type=int, nargs="+", default=[1, 2, 3], help="lease TTLs to try (seconds)")
    p.add_argument("--seconds", type=float, default=120.0, help="fault-free run per TTL (default 120)")
    p.add_argument("--burners", type=int, default=1, help="busy processes beside the job (default 1)")
    p.add_argument("--pace", type=float, default=5.0, help="the job's steps per second (the soak's: 5)")
    p.add_argument("--out", default="lease", help="results file name in benchmarks/results (default lease)")
    args = p.parse_args()
    if any(t < 1 for t in args.ttls):
        raise SystemExit("--ttls: a lease TTL is a whole number of seconds >= 1")
    trials = []
    for ttl in args.ttls:
        t = trial(ttl, args.seconds, args.burners, args.pace)
        trials.append(t)
        print(
            f"lease_ttl={ttl}: {t['false_expiries']} false expiry(ies) in {t['seconds']:.0f}s "
            f"(load avg 1m mean {t['load_avg_1m_mean']}, max {t['load_avg_1m_max']})",
            flush=True,
        )
    clean = [t["ttl"] for t in trials if t["false_expiries"] == 0]
    print("shortest TTL without a false expiry here:", min(clean) if clean else "none of", args.ttls)
    print("wrote", write_result(args.out, {"trials": trials, "config": vars(args)}))


if __name__ == "__main__":
    main()
