"""Recovery benchmark.

Part a: time from a node's SIGKILL / SIGSTOP to the survivors training again. Three nodes on this machine
train the example TorchRec DLRM (examples/dlrm/train.py, flash checkpoints); one node is killed (SIGKILL)
or frozen (SIGSTOP) once a checkpoint of world 3 is committed (replicated to a peer), and we measure until
the two survivors take a step at world size 2. elastic-rm:
`ermrun` with its defaults (lease TTL 2 s since benchmarks/lease; 5 s before). Baseline in the same run:
stock `torchrun` with the c10d backend and `--max-restarts 3` (its defaults otherwise; the frozen or killed
node is never the one hosting the c10d store). In-place variant (``ermrun-inplace/SIGKILL``): the example
run with --in-place, so the survivors' workers hold the failed collective and keep their processes into the
new round (docs/train.md, "Rounds in place"); each of its trials records a breakdown of the time
(benchmarks/recovery/breakdown.py) and the load average before and after. Writes
benchmarks/results/recovery.json and prints ratios.

Part b (``--part b``): downtime of a planned round, from rank 0's last step before it to the first step
after it at the new size: a scale-up 2 -> 3 (a third node arrives) and, where cgroups are writable, a
straggler swap (a member throttled to 0.1 CPU, replaced by the waiting node; the planner with
examples/dlrm/job.json). Baselines in the same run: torchrun's own scale-up (c10d: a third torchrun
arrives) and the restart from a disk checkpoint (the 2-node torchrun job stopped, a 3-node one started on
the same durable checkpoint directory). In-place variants (``ermrun-inplace/...``): the same rounds with
the example run with --in-place, so the workers of the nodes that stay keep their processes
(docs/train.md, "Rounds in place"); each trial also records every node's first step after the round and
the load average before and after it. Writes benchmarks/results/recovery-planned.json.
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

from benchmarks.common import end_run, fmt, stop_processes, summarize, write_result
from benchmarks.recovery.breakdown import breakdown
from benchmarks.recovery.breakdown import planned as planned_breakdown
from elastic_rm.etcd.server import EtcdServer, free_port
from elastic_rm.proc import signal_tree

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


def start_node(
    launcher: str,
    workdir: Path,
    endpoint: str,
    run_id: str,
    i: int,
    nnodes: str = "2:3",
    extra=(),
    tag: str = "",
    script_extra=(),
) -> subprocess.Popen:
    argv = [
        str(BIN / launcher),
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
    ]
    if launcher == "torchrun":
        argv += ["--rdzv-backend", "c10d"]
    else:
        argv += ["--node-id", f"n{i}", *extra]
    # a durable directory: torchrun has no peer transport, so a lost node's shards come from disk
    argv += [
        str(SCRIPT),
        "--progress-dir",
        str(workdir / "progress"),
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(workdir / "durable"),
        *script_extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = open(workdir / f"{launcher}{tag}-{i}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if i == 0 and launcher == "torchrun":
        time.sleep(3)  # node 0 hosts the c10d store; let it bind first
    return proc


def start_nodes(launcher: str, workdir: Path, endpoint: str, run_id: str) -> list[subprocess.Popen]:
    if launcher == "ermrun-inplace":
        return [
            start_node("ermrun", workdir, endpoint, run_id, i, script_extra=["--in-place"]) for i in range(3)
        ]
    return [start_node(launcher, workdir, endpoint, run_id, i) for i in range(3)]


def wait_committed(workdir: Path, world: int, steps: int, limit: float) -> bool:
    """Wait until ``world`` trained ``steps`` steps and a checkpoint of that world is committed (every
    rank's files in node memory and replicated to a peer): a node lost before its first checkpoint was
    replicated leaves nothing to restore its shards from (no durable copy of that step either)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        rows = progress(workdir)
        trained = len({r["step"] for r in steps_at(rows, world, 0)}) >= steps
        if trained and any("committed_step" in r and r["world"] == world for r in rows):
            return True
        time.sleep(0.2)
    return False


def trial(launcher: str, sig: int, limit: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"erm-recovery-{launcher}-"))
    run_id = f"rec-{uuid.uuid4().hex[:8]}"
    etcd = None
    if launcher.startswith("ermrun"):
        etcd = EtcdServer().start()
        endpoint = etcd.endpoint
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    load_before = os.getloadavg()
    procs = start_nodes(launcher, workdir, endpoint, run_id)
    try:
        if not wait_committed(workdir, 3, 10, 240):
            error = "never trained at world 3 with a committed checkpoint"
            return {"ok": False, "error": error, "workdir": str(workdir)}
        victim = procs[2]
        t_fault = time.time()
        signal_tree(victim.pid, sig)  # the node: its agent and its workers
        deadline = t_fault + limit
        while time.time() < deadline:
            after = steps_at(progress(workdir), 2, t_fault)
            ranks = {r["rank"] for r in after}
            if ranks >= {0, 1}:
                first = max(min(r["t"] for r in after if r["rank"] == k) for k in (0, 1))
                out = {"ok": True, "latency_s": first - t_fault}
                if launcher == "ermrun-inplace":
                    time.sleep(1)  # the agents' events of the round are written after the first step
                    out["breakdown"] = breakdown(endpoint, run_id, progress(workdir), t_fault)
                    out.update(load_avg_before=load_before, load_avg_after=os.getloadavg())
                return out
            time.sleep(0.1)
        return {"ok": False, "error": f"survivors did not train at world 2 within {limit:.0f}s"}
    finally:
        end_run(procs, etcd, run_id)


def round_change(rows: list[dict], since: float) -> dict | None:
    """Rank 0's last step before the first worker start after ``since``, and the first step after it."""
    rank0 = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: r["t"])
    start = next((r for r in rank0 if r.get("start") and r["t"] > since), None)
    if start is None:
        return None
    before = [r for r in rank0 if "step" in r and r["t"] < start["t"]]
    after = [r for r in rows if "step" in r and r["t"] > start["t"] and r["world"] == start["world"]]
    if not before or len({r["rank"] for r in after}) < start["world"]:
        return None
    firsts = {k: min(r["t"] for r in after if r["rank"] == k) for k in range(start["world"])}
    nodes = {r["rank"]: r["node"] for r in after}
    starts = [r for r in rows if r.get("start") and r["t"] > since and r["world"] == start["world"]]
    return {
        **phases(rows, before[-1]["t"], start["world"]),
        "downtime_s": max(firsts.values()) - before[-1]["t"],
        "last_step_t": before[-1]["t"],  # rank 0's last step before the round (unix time)
        "world": start["world"],
        "steps_redone": before[-1]["step"] - (start.get("restored_step") or 0),
        # per node of the new world: its first step, seconds after rank 0's last step before the round,
        # and whether its worker kept its process (rounds in place) or started new
        "first_step_after_s": {nodes[k]: round(t - before[-1]["t"], 3) for k, t in firsts.items()},
        "in_place": {r["node"]: bool(r.get("in_place")) for r in starts},
    }


def phases(rows: list[dict], last: float, world: int) -> dict:
    """Where a round's downtime went, seconds after rank 0's last step before it: the drain's checkpoint
    committed (the last "drained" row) and the new world's workers restored ("start" rows, written after
    process group, model, sharding and restore; absent under torchrun's own script paths)."""
    drained = [r["t"] for r in rows if "drained_step" in r and last - 1 <= r["t"]]
    restored = [r["t"] for r in rows if r.get("start") and r["world"] == world and r["t"] > last]
    return {
        "drained_after_s": round(max(drained) - last, 3) if drained else None,
        "restored_after_s": round(max(restored) - last, 3) if restored else None,
    }


def wait_steps(workdir: Path, world: int, n: int, since: float = 0.0, limit: float = 240.0) -> bool:
    deadline = time.time() + limit
    while time.time() < deadline:
        if len({r["step"] for r in steps_at(progress(workdir), world, since)}) >= n:
            return True
        time.sleep(0.2)
    return False


def wait_change(workdir: Path, since: float, limit: float) -> dict | None:
    deadline = time.time() + limit
    while time.time() < deadline:
        change = round_change(progress(workdir), since)
        if change is not None:
            return change
        time.sleep(0.2)
    return None


def planned_trial(kind: str, limit: float, agent_extra: tuple[str, ...] = ()) -> dict:
    """One planned size change; see the module docstring for what each kind is. ``agent_extra``: more
    ermrun flags (benchmarks.recovery.spares: --spares on/off)."""
    launcher = kind.split("/")[0].removesuffix("-inplace")
    script_extra = ["--in-place"] if "-inplace/" in kind else []
    workdir = Path(tempfile.mkdtemp(prefix="erm-planned-"))
    run_id = f"pl-{uuid.uuid4().hex[:8]}"
    etcd = EtcdServer().start() if launcher == "ermrun" else None
    endpoint = etcd.endpoint if etcd else f"127.0.0.1:{free_port()}"
    extra: list[str] = []
    if kind.endswith("straggler-swap"):
        job = json.loads((REPO / "examples" / "dlrm" / "job.json").read_text())
        job["planner"].update(max_step=0)  # never resize for throughput: n2 stays the spare
        (workdir / "job.json").write_text(json.dumps(job))
        extra = ["--job", str(workdir / "job.json"), "--cpu-limit", str(os.cpu_count() or 1)]
    if launcher == "ermrun":
        extra += agent_extra
    load_before = os.getloadavg()

    def node(i: int) -> subprocess.Popen:
        return start_node(launcher, workdir, endpoint, run_id, i, extra=extra, script_extra=script_extra)

    procs = [node(i) for i in range(2)]
    try:
        if not wait_steps(workdir, 2, 60 if kind == "torchrun/disk-restart" else 20):
            return {"ok": False, "error": "never trained at world 2", "workdir": str(workdir)}
        t0 = time.time()
        if kind.endswith("scale-up"):
            procs.append(node(2))
        elif kind.endswith("straggler-swap"):
            from elastic_rm.agent import cgroup as cg

            procs.append(node(2))
            time.sleep(25)  # n2 waits as the spare; the round is past its warm-up
            t0 = time.time()
            cg.NodeCgroup(cg.detect(), f"{run_id}.n1").set_cpu(0.1)
        else:  # torchrun/disk-restart: stop the 2-node job, start a 3-node one on the same disk copy
            for p in procs:
                signal_tree(p.pid, signal.SIGTERM)
            for p in procs:
                p.wait(60)
            new_id, new_endpoint = f"{run_id}-b", f"127.0.0.1:{free_port()}"
            procs += [
                start_node(launcher, workdir, new_endpoint, new_id, i, nnodes="3", tag="-restart")
                for i in range(3)
            ]
        change = wait_change(workdir, t0 + (5 if kind.endswith("straggler-swap") else 0), limit)
        if change is None:
            return {
                "ok": False,
                "error": f"no new round trained within {limit:.0f}s",
                "workdir": str(workdir),
            }
        load = {"load_avg_before": load_before, "load_avg_after": os.getloadavg()}
        if etcd is not None:  # per node and phase: where the downtime went (the rows have every time)
            time.sleep(1)  # the agents' events of the round are written after the first step
            change["breakdown"] = planned_breakdown(
                endpoint, run_id, progress(workdir), change["last_step_t"]
            )
        return {"ok": True, **change, **load}
    finally:
        stop_processes(procs)
        if etcd is not None:
            etcd.stop()
        if kind.endswith(
            "straggler-swap"
        ):  # the agents were SIGKILLed: their node cgroups are ours to remove
            from elastic_rm.agent import cgroup as cg

            for i in range(3):
                cg.NodeCgroup(cg.detect(), f"{run_id}.n{i}").remove()
        for rid in (run_id, f"{run_id}-b"):
            shutil.rmtree(Path("/dev/shm/elastic-rm") / rid, ignore_errors=True)


def main_planned(args: argparse.Namespace) -> None:
    from elastic_rm.agent import cgroup as cg

    kinds = ["ermrun/scale-up", "ermrun-inplace/scale-up", "torchrun/scale-up", "torchrun/disk-restart"]
    if cg.detect() is not None:
        kinds[2:2] = ["ermrun/straggler-swap", "ermrun-inplace/straggler-swap"]
    if args.kinds:
        unknown = set(args.kinds) - set(kinds)
        if unknown:
            raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {kinds}")
        kinds = [k for k in kinds if k in args.kinds]
    results: dict = {}
    for kind in kinds:
        # new processes, as measured before warm spares (their variants: benchmarks.recovery.spares)
        trials = [planned_trial(kind, args.limit, agent_extra=("--spares", "off")) for _ in range(args.runs)]
        down = [t["downtime_s"] for t in trials if t["ok"]]
        results[kind] = {
            **summarize(down),
            "runs": args.runs,
            "failed": args.runs - len(down),
            "steps_redone": [t.get("steps_redone") for t in trials if t["ok"]],
            "trials": [t for t in trials if t["ok"]],
            "errors": [t.get("error") for t in trials if not t["ok"]],
        }
        print(
            f"{kind:24s} downtime median {fmt(results[kind]['median']):>9s}  failed "
            f"{args.runs - len(down)}/{args.runs}",
            flush=True,
        )

    def median(kind: str) -> float | None:
        return results.get(kind, {}).get("median")

    ratios: dict[str, float | None] = {}
    print("\nratios (baseline downtime / elastic-rm downtime; higher is better):")
    for kind in (k for k in results if k.startswith("ermrun")):
        bases = {"torchrun/disk-restart": median("torchrun/disk-restart")}
        if kind.endswith("scale-up"):
            bases["torchrun/scale-up"] = median("torchrun/scale-up")
        for base, value in bases.items():
            ours = median(kind)
            ratio = value / ours if value and ours else None
            ratios[f"{kind} vs {base}"] = ratio
            print(f"  {kind} vs {base}: {ratio:.1f}x" if ratio else f"  {kind} vs {base}: n/a")
    name = (
        "recovery-planned"
        if not args.kinds
        else "recovery-planned-" + "+".join(k.replace("/", "-") for k in kinds)
    )
    print("wrote", write_result(name, {"results": results, "ratios": ratios, "config": vars(args)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="trials of elastic-rm per fault (default 2)")
    p.add_argument("--baseline-runs", type=int, default=1, help="trials of torchrun per fault (default 1)")
    p.add_argument("--limit", type=float, default=90.0, help="seconds to wait for recovery (default 90)")
    p.add_argument("--part", choices=("a", "b"), default="a", help="a: faults (default); b: planned rounds")
    p.add_argument(
        "--kinds",
        nargs="*",
        default=None,
        help="part b: only these kinds (e.g. ermrun-inplace/scale-up); the result file is named after them",
    )
    args = p.parse_args()
    if args.part == "b":
        main_planned(args)
        return
    results: dict = {}
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        launchers = [("ermrun", args.runs), ("torchrun", args.baseline_runs)]
        if sig == signal.SIGKILL:  # a frozen peer fails no collective: in place changes nothing there
            launchers.insert(1, ("ermrun-inplace", args.runs))
        for launcher, runs in launchers:
            name = f"{launcher}/{signal.Signals(sig).name}"
            trials = [trial(launcher, sig, args.limit) for _ in range(runs)]
            lat = [t["latency_s"] for t in trials if t["ok"]]
            results[name] = {
                **summarize(lat),
                "runs": runs,
                "failed": runs - len(lat),
                "errors": [t.get("error") for t in trials if not t["ok"]],
            }
            if launcher == "ermrun-inplace":
                results[name]["trials"] = [t for t in trials if t["ok"]]
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
    inplace, base = results["ermrun-inplace/SIGKILL"]["median"], results["torchrun/SIGKILL"]["median"]
    ratios["SIGKILL-inplace"] = base / inplace if inplace and base else None
    print(
        "  SIGKILL in place: " + (f"{ratios['SIGKILL-inplace']:.1f}x" if ratios["SIGKILL-inplace"] else "n/a")
    )
    print("wrote", write_result("recovery", {"results": results, "ratios": ratios, "config": vars(args)}))


if __name__ == "__main__":
    main()
