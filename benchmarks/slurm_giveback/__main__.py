"""Run the give-back latency benchmark (benchmarks/slurm_giveback/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.slurm_jobs.__main__ import EMULATION_OFF, give_backs
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.obs.events import read_etcd
from elastic_rm.proc import kill_tree
from elastic_rm.wire.keyspace import Keyspace
from tests.slurm.cluster import SlurmCluster, why_not

REPO = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)
NODES = 4
CURVE = "1:1,2:1.5,3:1.8,4:2.0"
CONF = "lease_ttl=5,last_call_timeout=1,join_timeout=600"
STAGES = ("since_submit_s", "decision_s", "drain_s", "ended_s", "total_s")


def launch(etcd, cluster: SlurmCluster, work: Path, run_id: str) -> subprocess.Popen:
    desc = json.loads((REPO / "examples" / "emulated" / "job.json").read_text())
    desc.update(name=run_id, request={"nodes": 1})
    desc["planner"].update(EMULATION_OFF)
    (work / "job.json").write_text(json.dumps(desc))
    argv = [os.path.join(BIN, "erm"), "launch", "--slurm", "--slurm-output", str(work / "%x-%j.out")]
    argv += ["--workdir", str(REPO), "--poll-interval", "0.5", "--stop-grace", "15"]
    argv += ["--job", str(work / "job.json"), "--nnodes", f"1:{NODES}", "--nproc-per-node", "1"]
    argv += ["--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--rdzv-conf", CONF]
    argv += ["examples/emulated/train.py", "--samples", str(10**9), "--step-s", "0.5", "--curve", CURVE]
    argv += ["--noise", "0.02", "--state", str(work / "state")]
    log = open(work / "launch.log", "wb")
    return subprocess.Popen(
        argv, env=cluster.env(), cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def running(cluster: SlurmCluster, name: str) -> int:
    r = cluster.cmd("squeue", "-h", "-t", "R", "-n", name, "-o", "%i", check=False)
    return len(r.stdout.split())


def wait(what: str, ok, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.2)


def one(etcd, cluster: SlurmCluster, root: Path) -> dict:
    run_id = f"gb-{uuid.uuid4().hex[:6]}"
    work = root / run_id
    work.mkdir()
    p = launch(etcd, cluster, work, run_id)
    try:
        wait("the run grown past its request", lambda: running(cluster, f"erm-{run_id}") >= 3, 240)
        time.sleep(15)  # a round or two at that size: the planner's model of it
        other = cluster.cmd(
            "sbatch", "--parsable", "-N", "2", "-J", "other", "-o", "/dev/null", "--wrap", "sleep 30"
        ).stdout.strip()
        submitted = time.time()
        wait("the waiting job running", lambda: running(cluster, "other") == 1, 240)
        started = time.time()
        with EtcdClient(etcd.endpoint) as client:
            events, _, _ = read_etcd(client, Keyspace("/elastic-rm", run_id))
        chains = [c for c in give_backs(events, [submitted]) if c["t"] >= submitted]
        if not chains:
            raise RuntimeError("no queue event after the other job's submission")
        chain = chains[0]
        chain["submit_to_running_s"] = started - submitted
        chain["t"] -= submitted
        cluster.cmd("scancel", other, check=False)
        return chain
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
        cluster.reset(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3, help="give-backs measured, each on a fresh run")
    args = ap.parse_args()
    reason = why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    root = Path(tempfile.mkdtemp(prefix="erm-bench-giveback-"))
    chains, loads = [], []
    try:
        with EtcdServer() as etcd, SlurmCluster(NODES) as cluster:
            for i in range(args.repeat):
                loads.append(os.getloadavg()[0])
                chains.append(one(etcd, cluster, root))
                print(f"give-back {i + 1}: {json.dumps(chains[-1])}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"give_backs": chains, "config": {"nodes": NODES, "curve": CURVE, "repeat": args.repeat}}
    for stage in (*STAGES, "submit_to_running_s"):
        values = [c[stage] for c in chains if c.get(stage) is not None]
        if values:
            result[stage] = {"median": statistics.median(values), "max": max(values), "n": len(values)}
    result["machine_load"] = {"load_avg_1m_at_each": loads}
    print(json.dumps({k: v for k, v in result.items() if k != "give_backs"}))
    print("wrote", write_result("slurm-giveback", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
