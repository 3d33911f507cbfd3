"""Rendezvous benchmark: elastic-rm against torch's c10d and etcd-v2 backends, in one run.

(a) join: time from the last of N nodes starting to join until all N hold their rank, N = 8, 32, 128;
    handlers in threads of one process (for the baselines as for elastic-rm), and for elastic-rm
    also spread over 8 processes. (b) failure: time from a member's SIGKILL (survivors re-join at once,
    as after their workers crash) and from its SIGSTOP (survivors re-join only when num_nodes_waiting()
    says so, as torch's agent does) until the survivors hold the next round.

Run: `make bench` or `.venv/bin/python -m benchmarks.rendezvous [--runs 5] [--quick]`.
Writes benchmarks/results/rendezvous.json and prints ratios against each baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from benchmarks.common import fmt, summarize, write_result
from elastic_rm.etcd.server import EtcdServer, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable


def start_tcpstore() -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = (
        "import time, datetime, torch.distributed as d;"
        f"s=d.TCPStore('127.0.0.1',{port},is_master=True,multi_tenant=True,timeout=datetime.timedelta(seconds=600));"
        "print('ready',flush=True);time.sleep(1e6)"
    )
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def join_trial(backend: str, endpoint: str, n: int, procs: int, timeout: float) -> dict:
    run_id = f"j{uuid.uuid4().hex[:8]}"
    tmp = tempfile.mkdtemp(prefix="erm-bench-")
    start_file = os.path.join(tmp, "start")
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = []
    for i, k in enumerate(per):
        argv = [
            PY,
            os.path.join(HERE, "join_trial.py"),
            "--backend",
            backend,
            "--endpoint",
            endpoint,
            "--world",
            str(n),
            "--handlers",
            str(k),
            "--run-id",
            run_id,
            "--join-timeout",
            str(timeout),
            "--ready-file",
            os.path.join(tmp, f"ready{i}"),
            "--start-at-file",
            start_file,
        ]
        children.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True))
    deadline = time.time() + 300
    while (
        not all(os.path.exists(os.path.join(tmp, f"ready{i}")) for i in range(procs))
        and time.time() < deadline
    ):
        time.sleep(0.05)
    with open(start_file + ".tmp", "w") as fh:
        fh.write(str(time.time() + 1.0))
    os.replace(start_file + ".tmp", start_file)
    starts, ends, ranks, errors = [], [], [], []
    for child in children:
        try:
            out, _ = child.communicate(timeout=timeout + 60)
            data = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
            stop(child)
            data = {"starts": [], "ends": [], "ranks": [], "errors": ["trial process failed"]}
        starts += data["starts"]
        ends += data["ends"]
        ranks += data["ranks"]
        errors += [e for e in data["errors"] if e]
    ok = not errors and sorted(ranks) == list(range(n))
    return {"ok": ok, "latency_s": (max(ends) - max(starts)) if ok else None, "errors": errors[:3]}


def failure_trial(backend: str, endpoint: str, sig: int, limit: float) -> dict:
    run_id = f"f{uuid.uuid4().hex[:8]}"
    argv = [
        PY,
        os.path.join(HERE, "node.py"),
        "--backend",
        backend,
        "--endpoint",
        endpoint,
        "--run-id",
        run_id,
        "--limit",
        str(limit),
    ]
    nodes = [
        subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        for _ in range(3)
    ]
    try:
        firsts = [json.loads(n.stdout.readline()) for n in nodes]  # type: ignore[union-attr]
        assert {f["world"] for f in firsts} == {3}, firsts
        victim = nodes[-1]
        t_fault = time.time()
        victim.send_signal(sig)
        command = "go\n" if sig == signal.SIGKILL else "watch\n"
        for n in nodes[:-1]:
            n.stdin.write(command)  # type: ignore[union-attr]
            n.stdin.flush()  # type: ignore[union-attr]
        seconds = []
        for n in nodes[:-1]:
            try:
                out, _ = n.communicate(timeout=limit + 30)
            except subprocess.TimeoutExpired:
                return {"ok": False, "latency_s": None, "error": f"no new round within {limit:.0f}s"}
            line = json.loads(out.strip().splitlines()[-1])
            if line.get("round") != 2 or line.get("world") != 2:
                return {"ok": False, "latency_s": None, "error": line.get("error", str(line))}
            seconds.append(line["t"] - t_fault)
        return {"ok": True, "latency_s": max(seconds)}
    finally:
        for n in nodes:
            if n.poll() is None:
                n.send_signal(signal.SIGCONT)
                stop(n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs of elastic-rm per case")
    p.add_argument("--baseline-runs", type=int, default=3, help="runs of each torch backend per case")
    p.add_argument("--sizes", default="8,32,128")
    p.add_argument("--quick", action="store_true", help="1 run each, N = 8 and 32, no failure baselines")
    args = p.parse_args()
    if args.quick:
        args.runs, args.baseline_runs, args.sizes = 1, 1, "8,32"
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict = {"join": {}, "failure": {}, "config": vars(args)}

    etcd = EtcdServer(extra_args=["--enable-v2"]).start()  # one etcd for elastic-rm and etcd-v2
    store, store_ep = start_tcpstore()
    try:
        cases = [
            ("elastic-rm", etcd.endpoint, 1, args.runs),
            ("elastic-rm", etcd.endpoint, 8, args.runs),
            ("c10d", store_ep, 1, args.baseline_runs),
            ("etcd-v2", etcd.endpoint, 1, args.baseline_runs),
        ]
        for backend, endpoint, procs, runs in cases:
            for n in sizes:
                if procs > n:
                    continue
                name = f"{backend}/{'threads' if procs == 1 else f'{procs}procs'}/N={n}"
                timeout = 60.0 if backend != "elastic-rm" else 30.0
                trials = [
                    join_trial(backend, endpoint, n, procs, timeout)
                    for _ in range(runs if n < 128 or backend == "elastic-rm" else min(runs, 2))
                ]
                lat = [t["latency_s"] for t in trials if t["ok"]]
                results["join"][name] = {
                    **summarize(lat),
                    "runs": len(trials),
                    "failed": len(trials) - len(lat),
                    "errors": [e for t in trials for e in t["errors"]][:3],
                }
                print(
                    f"join {name:32s} median {fmt(results['join'][name]['median']):>9s}  "
                    f"max {fmt(results['join'][name]['max']):>9s}  failed "
                    f"{len(trials) - len(lat)}/{len(trials)}",
                    flush=True,
                )
        if not args.quick:
            for backend, endpoint, runs in (("elastic-rm", etcd.endpoint, 3), ("c10d", store_ep, 1)):
                for sig in (signal.SIGKILL, signal.SIGSTOP):
                    name = f"{backend}/{signal.Signals(sig).name}"
                    limit = 40.0 if backend == "elastic-rm" else 90.0
                    trials = [failure_trial(backend, endpoint, sig, limit) for _ in range(runs)]
                    lat = [t["latency_s"] for t in trials if t["ok"]]
                    results["failure"][name] = {
                        **summarize(lat),
                        "runs": runs,
                        "failed": runs - len(lat),
                        "errors": [t.get("error") for t in trials if not t["ok"]],
                    }
                    print(
                        f"failure {name:20s} median {fmt(results['failure'][name]['median']):>9s}  failed "
                        f"{runs - len(lat)}/{runs}",
                        flush=True,
                    )
    finally:
        stop(store)
        etcd.stop()

    print("\nratios (baseline median / elastic-rm median; higher is better):")
    ratios = {}
    for n in sizes:
        ours = results["join"].get(f"elastic-rm/threads/N={n}", {}).get("median")
        for base in ("c10d", "etcd-v2"):
            b = results["join"].get(f"{base}/threads/N={n}", {})
            ratio = (b["median"] / ours) if ours and b.get("median") else None
            ratios[f"join/N={n}/{base}"] = ratio
            note = f"{ratio:.1f}x" if ratio else f"baseline failed {b.get('failed')}/{b.get('runs')} runs"
            print(f"  join N={n:<4d} vs {base:8s}: {note}")
    for sig in ("SIGKILL", "SIGSTOP"):
        ours = results["failure"].get(f"elastic-rm/{sig}", {}).get("median")
        b = results["failure"].get(f"c10d/{sig}", {})
        if ours is not None and b:
            ratio = (b["median"] / ours) if b.get("median") else None
            ratios[f"failure/{sig}/c10d"] = ratio
            print(
                f"  {sig} -> next round vs c10d: "
                + (f"{ratio:.1f}x" if ratio else "c10d never formed the next round")
            )
    results["ratios"] = ratios
    print("\nwrote", write_result("rendezvous", results))


if __name__ == "__main__":
    main()
