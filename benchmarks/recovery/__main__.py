"""Recovery benchmark (issue 6, part a): time from a node's SIGKILL / SIGSTOP to the survivors training again.

Three nodes on this machine train the example TorchRec DLRM (examples/dlrm/train.py, flash checkpoints);
one node is killed (SIGKILL) or frozen (SIGSTOP) and we measure until the two survivors take a step at
world size 2. elastic-rm: `ermrun` with its defaults (lease TTL 5 s). Baseline in the same run: stock
`torchrun` with the c10d backend and `--max-restarts 3` (its defaults otherwise; the frozen or killed node is
never the one hosting the c10d store). Writes benchmarks/results/recovery.json and prints ratios.
"""

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

from benchmarks.common import fmt, summarize, write_result
from elastic_rm.etcd.server import EtcdServer, free_port
from elastic_rm.proc import kill_tree, signal_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "dlrm" / "train.py"
BIN = Path(sys.executable).parent


def progress(workdir: Path) -> list[dict]:
    rows = []
    for path in (workdir / "progress").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # cut by SIGKILL
    return rows


def steps_at(rows: list[dict], world: int, since: float) -> list[dict]:
    return [r for r in rows if "step" in r and r["world"] == world and r["t"] > since]


def start_nodes(launcher: str, workdir: Path, endpoint: str, run_id: str) -> list[subprocess.Popen]:
    procs = []
    for i in range(3):
        argv = [str(BIN / launcher), "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                "--rdzv-id", run_id, "--max-restarts", "3", "--monitor-interval", "0.1"]  # fmt: skip
        if launcher == "torchrun":
            argv += ["--rdzv-backend", "c10d"]
        else:
            argv += ["--node-id", f"n{i}"]
        argv += [str(SCRIPT), "--progress-dir", str(workdir / "progress"), "--checkpoint-every", "10"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        log = open(workdir / f"{launcher}-{i}.log", "wb")
        procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )
        if i == 0 and launcher == "torchrun":
            time.sleep(3)  # node 0 hosts the c10d store; let it bind first
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_tree(p.pid)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def trial(launcher: str, sig: int, limit: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"erm-recovery-{launcher}-"))
    run_id = f"rec-{uuid.uuid4().hex[:8]}"
    etcd = None
    if launcher == "ermrun":
        etcd = EtcdServer().start()
        endpoint = etcd.endpoint
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    procs = start_nodes(launcher, workdir, endpoint, run_id)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and len({r["step"] for r in steps_at(progress(workdir), 3, 0)}) < 10:
            time.sleep(0.2)
        if len({r["step"] for r in steps_at(progress(workdir), 3, 0)}) < 10:
            return {"ok": False, "error": "never trained at world 3", "workdir": str(workdir)}
        victim = procs[2]
        t_fault = time.time()
        signal_tree(victim.pid, sig)  # the node: its agent and its workers
        deadline = t_fault + limit
        while time.time() < deadline:
            after = steps_at(progress(workdir), 2, t_fault)
            ranks = {r["rank"] for r in after}
            if ranks >= {0, 1}:
                first = max(min(r["t"] for r in after if r["rank"] == k) for k in (0, 1))
                return {"ok": True, "latency_s": first - t_fault}
            time.sleep(0.1)
        return {"ok": False, "error": f"survivors did not train at world 2 within {limit:.0f}s"}
    finally:
        stop(procs)
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(Path("/dev/shm/elastic-rm") / run_id, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="trials of elastic-rm per fault (default 2)")
    p.add_argument("--baseline-runs", type=int, default=1, help="trials of torchrun per fault (default 1)")
    p.add_argument("--limit", type=float, default=90.0, help="seconds to wait for recovery (default 90)")
    args = p.parse_args()
    results: dict = {}
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        for launcher, runs in (("ermrun", args.runs), ("torchrun", args.baseline_runs)):
            name = f"{launcher}/{signal.Signals(sig).name}"
            trials = [trial(launcher, sig, args.limit) for _ in range(runs)]
            lat = [t["latency_s"] for t in trials if t["ok"]]
            results[name] = {**summarize(lat), "runs": runs, "failed": runs - len(lat),
                             "errors": [t.get("error") for t in trials if not t["ok"]]}  # fmt: skip
            print(
                f"{name:18s} median {fmt(results[name]['median']):>9s}  failed {runs - len(lat)}/{runs}",
                flush=True,
            )
    ratios = {}
    print("\nratios (torchrun / elastic-rm; higher is better):")
    for sig in ("SIGKILL", "SIGSTOP"):
        ours, base = results[f"ermrun/{sig}"]["median"], results[f"torchrun/{sig}"]["median"]
        ratios[sig] = base / ours if ours and base else None
        note = f"{ratios[sig]:.1f}x" if ratios[sig] else f"torchrun did not recover within {args.limit:.0f}s"
        print(f"  {sig}: {note}")
    print("wrote", write_result("recovery", {"results": results, "ratios": ratios, "config": vars(args)}))


if __name__ == "__main__":
    main()
