"""Scale benchmark: the control plane with N simulated nodes (and many jobs) on one real etcd.

Each case starts a fresh etcd (default 100 ms heartbeats, revision compaction as `erm etcd` sets it),
one process holding the first node (it wins the election: the leader's CPU and memory are that process's),
one process holding a single node to kill, and the other nodes spread over ``--procs`` processes
(benchmarks/scale/nodes.py: real handlers through torch's registry, doing what each node's agent does to
the control plane). Measured, per N:

- join: from the last node's ``next_rendezvous()`` call until all N hold their rank (all ranks checked);
  ``--only join --trials K``: K joins per case, each on a fresh etcd, reported as the middle one
  (``--only failure --trials K`` likewise for the failure round);
  fan-out: from the sealed round's write to each node holding it;
- steady state (``--steady`` s): CPU of the leader's process, of the node processes (per node), of etcd;
  etcd writes/s (puts, deletes, txns), database size, keep-alive gaps of every lease, rounds that churned;
- ``erm status`` (one read of the run) and one ``erm top`` frame, at N;
- failure: the lone node is SIGKILLed; time until every survivor holds the next round (with
  ``--ckpt-ports`` its refused checkpoint port ends its lease early: rendezvous/dead_peers.py; without,
  its lease's TTL does).

``--jobs J``: J jobs of N nodes each on the same etcd (leaders wherever they win; the node killed is the
first job's).
Baseline in the same run: the N=128 case (``--sizes`` starts with it); c10d's join is in
benchmarks/rendezvous. With ``--ckpt-ports``, each case is followed by ``<case>-ttl-only``: the same join
and failure with no checkpoint ports, so the killed node's lease ends by its TTL (the ratio
``failure.<case>/ttl-only``). Writes benchmarks/results/scale.json (or ``--name``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid

from benchmarks.common import stop_processes, summarize, write_result
from benchmarks.scale.child import Child
from benchmarks.scale.etcd_stats import cpu_seconds, rss_bytes, scrape
from benchmarks.scale.failure import (
    after_failure,
    failure_round,
    keepalive_stats,
    quantile,
    reports_of,
    settle,
)
from elastic_rm.etcd.server import EtcdServer


class WriteCounter:
    """Writes per second under the runs' prefix by key kind (nodes, metrics, events, ...), from a watch."""

    def __init__(self, endpoint: str):
        from elastic_rm.etcd.client import EtcdClient

        self._client = EtcdClient(endpoint, timeout=30)
        self.counts: dict[str, int] = {}

        def count(events) -> None:
            for e in events:
                parts = e.kv.key.split("/")
                kind = f"{e.kind}:{parts[3] if len(parts) > 3 else '?'}"
                self.counts[kind] = self.counts.get(kind, 0) + 1

        self._cancel = self._client.watch_prefix("/elastic-rm/", self._client.ping() + 1, count)

    def stop(self, seconds: float) -> dict[str, float]:
        self._cancel()
        self._client.close()
        return {k: v / seconds for k, v in sorted(self.counts.items())}


def spread(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def cpu_of(children: list[Child]) -> list[float]:
    out = []
    for c in children:
        try:
            out.append(cpu_seconds(c.proc.pid))
        except Exception:  # noqa: BLE001 - a dead process
            out.append(float("nan"))
    return out


def status_latency(endpoint: str, run_id: str, repeats: int = 3) -> dict:
    """`erm status` (one read of the run, parsed) and one `erm top` frame (status from the watched copy,
    rendered), timed in this process."""
    from rich.console import Console

    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.obs.status import job_status, status_from_kvs
    from elastic_rm.wire.keyspace import Keyspace
    from launcher.commands.status import render
    from launcher.commands.top import WatchedRun

    keys = Keyspace("/elastic-rm", run_id)
    status_s, top_s, keys_read = [], [], 0
    with EtcdClient(endpoint, timeout=30) as client:
        console = Console(file=open(os.devnull, "w"), width=160)
        for _ in range(repeats):
            t0 = time.perf_counter()
            status = job_status(client, keys)
            console.print(render(status))
            status_s.append(time.perf_counter() - t0)
        round_kv = client.get(keys.round)
        watched = WatchedRun(client, keys)
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                kvs, revision, _err = watched.snapshot()
                console.print(render(status_from_kvs(keys, kvs, revision)))
                top_s.append(time.perf_counter() - t0)
                keys_read = len(kvs)
        finally:
            watched.close()
    return {
        "status_s": summarize(status_s),
        "top_frame_s": summarize(top_s),
        "keys": keys_read,
        "members_shown": len(status.get("members", [])),
        "round_value_bytes": len(round_kv.value) if round_kv else None,
    }


def run_case(
    n: int,
    jobs: int,
    procs: int,
    steady: float,
    fail: bool,
    log_dir: str,
    join_only: bool = False,
    profile: str = "",
    only_failure: bool = False,
) -> dict:
    """One case; ``join_only``: the join alone (no steady state, status or failure); ``only_failure``:
    the join, then the failure round (no steady state or status)."""
    etcd = EtcdServer(fast_election=False).start()
    endpoint = etcd.endpoint
    etcd_pid = etcd.members[0].proc.pid  # type: ignore[union-attr]
    tmp = tempfile.mkdtemp(prefix="erm-scale-", dir=log_dir)
    start_file = os.path.join(tmp, "start")
    runs = [f"s{uuid.uuid4().hex[:6]}" for _ in range(jobs)]
    lo = max(1, n // 2)
    children: list[Child] = []
    try:
        leader = victim = None
        rest = n
        if jobs == 1:
            leader = Child(endpoint, f"{runs[0]}:{lo}:{n}:1", start_file, tmp, "leader", profile)
            leader.expect("ready", 120)
            _wait_leader(endpoint, runs[0])
            children.append(leader)
            rest -= 1
            if fail:
                victim = Child(endpoint, f"{runs[0]}:{lo}:{n}:1", start_file, tmp, "victim")
                children.append(victim)
                rest -= 1
        elif fail:  # many jobs: the first job's node to kill (its leader is wherever it wins)
            victim = Child(endpoint, f"{runs[0]}:{lo}:{n}:1", start_file, tmp, "victim")
            children.append(victim)
        shares = [spread(rest if jobs == 1 else n - (j == 0 and fail), procs) for j in range(jobs)]
        workers = []
        for i in range(procs):
            spec = ",".join(f"{run}:{lo}:{n}:{shares[j][i]}" for j, run in enumerate(runs) if shares[j][i])
            workers.append(Child(endpoint, spec, start_file, tmp, f"nodes{i}", profile))
        children += workers
        for c in children:
            if c is not leader:
                c.expect("ready", 600)
        with open(start_file + ".tmp", "w") as fh:
            fh.write(str(time.time() + 1.0))
        os.replace(start_file + ".tmp", start_file)
        rows = []
        for c in children:
            rows += [dict(r, proc=c.tag) for r in c.expect("joined", 300)["rows"]]
        join = _join_result(rows, runs, n)
        print(
            f"N={n} x {jobs}: join {join['latency_s']} s ok={join['ok']} fan-out {join['fanout_s']}",
            flush=True,
        )
        join["load_avg"] = os.getloadavg()
        if join_only:
            return {"n": n, "jobs": jobs, "procs": procs, "join": join}

        time.sleep(5)  # the first metrics records and samples settle
        if only_failure and victim is not None:
            result = {"n": n, "jobs": jobs, "procs": procs, "join": join}
            settled = settle(children)
            lost_before = sum(r["lease_lost"] for r in reports_of([c for c in children if c is not victim]))
            result["failure"] = failure_round(victim, children, n, runs[0])
            result["failure"].update(after_failure(children, victim))
            result["failure"]["lease_lost_in_failure"] = result["failure"]["lease_lost"] - lost_before
            result["failure"]["before_kill"] = settled | {"lease_lost": lost_before}
            print(f"  failure: {result['failure']}", flush=True)
            return result
        counter = WriteCounter(endpoint)
        m0, e0, c0, t0 = scrape(endpoint), cpu_seconds(etcd_pid), cpu_of(children), time.monotonic()
        time.sleep(steady)
        m1, e1, c1, t1 = scrape(endpoint), cpu_seconds(etcd_pid), cpu_of(children), time.monotonic()
        by_kind = counter.stop(t1 - t0)
        span = t1 - t0
        for c in children:
            c.send("report")
        reports = [c.expect("report", 60) for c in children]
        churn = [o for c in children for o in c.other if o.get("ev") == "round"]
        steady_r = _steady_result(m0, m1, e1 - e0, c0, c1, span, children, leader, reports, churn)
        steady_r["etcd_rss_bytes"] = rss_bytes(etcd_pid)
        steady_r["writes_per_s_by_kind"] = by_kind
        print(f"  steady: {json.dumps(steady_r)}", flush=True)
        status = status_latency(endpoint, runs[0])  # the first job's (all jobs are alike)
        print(f"  status: {status}", flush=True)
        result = {"n": n, "jobs": jobs, "procs": procs, "join": join, "steady": steady_r, "status": status}
        if fail and victim is not None:
            result["failure"] = failure_round(victim, children, n, runs[0])
            print(f"  failure: {result['failure']}", flush=True)
        result["etcd_end"] = scrape(endpoint)
        return result
    finally:
        for c in children:
            c.send("exit")
        time.sleep(0.5)
        stop_processes([c.proc for c in children])
        etcd.stop()


def _wait_leader(endpoint: str, run_id: str) -> None:
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.wire.keyspace import Keyspace

    with EtcdClient(endpoint) as client:
        deadline = time.time() + 60
        while client.get(Keyspace("/elastic-rm", run_id).leader) is None:
            if time.time() > deadline:
                raise TimeoutError("the first node did not lead within 60 s")
            time.sleep(0.05)


def middle_trial(runs: list[dict], latency) -> dict:
    """The middle of ``runs`` by ``latency(run)`` (the median for an odd count; a run without one, failed,
    ranks last)."""
    ranked = sorted(runs, key=lambda r: latency(r) if latency(r) is not None else float("inf"))
    return ranked[len(ranked) // 2]


def join_trials(n: int, jobs: int, procs: int, log_dir: str, trials: int, profile: str = "") -> dict:
    """``trials`` joins of one case, each on a fresh etcd with fresh processes (the target is a median, and
    one join on a shared 2-core machine moves by a factor of two from run to run): the case's join is the
    middle trial by latency (the median for an odd count), with every trial's latency and correctness."""
    runs = [run_case(n, jobs, procs, 0, True, log_dir, True, profile)["join"] for _ in range(trials)]
    middle = middle_trial(runs, lambda r: r["latency_s"])
    trials_out = [{"latency_s": r["latency_s"], "ok": r["ok"], "load_avg": r.get("load_avg")} for r in runs]
    return {
        "n": n,
        "jobs": jobs,
        "procs": procs,
        "join": dict(middle, ok=all(r["ok"] for r in runs), trials=trials_out),
    }


def failure_trials(n: int, jobs: int, procs: int, log_dir: str, trials: int) -> dict:
    """``trials`` failure rounds of one case, each after its own join on a fresh etcd (where the kill falls
    in the killed node's refresh cycle moves a lease's expiry by a third of its TTL): the case reports the
    middle trial by the failure round's latency, with every trial's breakdown."""
    runs = [run_case(n, jobs, procs, 0, True, log_dir, only_failure=True) for _ in range(trials)]
    middle = middle_trial(runs, lambda r: r.get("failure", {}).get("latency_s"))
    keep = ("ok", "latency_s", "round_written_s", "median_s", "p99_s", "lease_lost_in_failure", "load_avg")
    each = [{k: r.get("failure", {}).get(k) for k in keep} for r in runs]
    return dict(middle, failure=dict(middle["failure"], ok=all(t["ok"] for t in each), trials=each))


def _join_result(rows: list[dict], runs: list[str], n: int) -> dict:
    per_run = {}
    for run in runs:
        mine = [r for r in rows if r.get("run") == run]
        errors = [r["error"] for r in mine if "error" in r]
        ok = not errors and sorted(r.get("rank", -1) for r in mine) == list(range(n))
        ok = ok and all(r.get("world") == n for r in mine)
        latency = max(r["end"] for r in mine) - max(r["start"] for r in mine) if ok else None
        fanout = [r["end"] - r["round_time"] for r in mine if "round_time" in r]
        per_run[run] = {
            "ok": ok,
            "latency_s": latency,
            "errors": errors[:3],
            "fanout_s": summarize(fanout) if fanout else None,
        }
    lat = [v["latency_s"] for v in per_run.values() if v["latency_s"] is not None]
    fanout = [r["end"] - r["round_time"] for r in rows if "round_time" in r]
    # the leader's decision (the round record's time) after the last next_rendezvous() call: registrations
    decided = [
        r["round_time"] - max(x["start"] for x in rows if x.get("run") == r["run"])
        for r in rows
        if "round_time" in r
    ]
    phases = {
        "register_s": [r["register_done"] - r["register"] for r in rows if "register_done" in r],
        "seen_after_write_s": [r["seen"] - r["round_time"] for r in rows if "seen" in r],
        "join_call_s": [r["seen_done"] - r["seen"] for r in rows if "seen_done" in r],
    }
    by_proc: dict[str, list[float]] = {}
    for r in rows:
        if "seen" in r:
            by_proc.setdefault(r["proc"], []).append(r["seen"] - r["round_time"])
    phases_by_proc = {p: {"median": quantile(v, 0.5), "max": max(v)} for p, v in sorted(by_proc.items())}
    return {
        "ok": all(v["ok"] for v in per_run.values()),
        "latency_s": max(lat) if lat else None,
        "seen_after_write_by_process_s": phases_by_proc,
        "phases": {k: dict(summarize(v), p90=quantile(v, 0.9)) for k, v in phases.items()},
        "fanout_s": summarize(fanout),
        "fanout_p90_s": quantile(fanout, 0.9),
        "decided_after_s": max(decided) if decided else None,
        "per_run": list(per_run.values()),
    }


def _steady_result(m0, m1, etcd_cpu, c0, c1, span, children, leader, reports, churn) -> dict:
    rate = lambda k: (m1.get(k, 0) - m0.get(k, 0)) / span  # noqa: E731
    node_cores = []
    leader_cores = None
    for c, a, b, rep in zip(children, c0, c1, reports, strict=True):
        cores = (b - a) / span
        if c is leader:
            leader_cores = cores
        else:
            node_cores.append(cores / max(1, rep["nodes"]))
    lease_lost = sum(r["lease_lost"] for r in reports)
    return {
        "seconds": span,
        "leader_cores": leader_cores,
        "leader_rss_bytes": rss_bytes(leader.proc.pid) if leader is not None else None,
        "node_cores_per_node": summarize(node_cores),
        "process_cores": [(b - a) / span for a, b in zip(c0, c1, strict=True)],
        "etcd_cores": etcd_cpu / span,
        "etcd_puts_per_s": rate("puts"),
        "etcd_deletes_per_s": rate("deletes"),
        "etcd_txns_per_s": rate("txns"),
        "etcd_writes_per_s": rate("puts") + rate("deletes") + rate("txns"),
        "etcd_revisions_per_s": rate("revision"),
        "db_bytes_start": m0.get("db_bytes"),
        "db_bytes_end": m1.get("db_bytes"),
        "db_in_use_bytes_end": m1.get("db_in_use_bytes"),
        "watchers": m1.get("watchers"),
        "published_per_s": sum(r["published"] for r in reports) / max(span, 1e-9),
        "max_keepalive_gap_s": max(r["max_gap_s"] for r in reports),
        **keepalive_stats(reports),
        "lease_ttl_s": reports[0]["lease_ttl_s"],
        "lease_lost": lease_lost,
        "rounds_churned": len(churn),
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="128,512,1024")
    p.add_argument("--procs", type=int, default=8, help="node processes per case (besides leader and victim)")
    p.add_argument("--steady", type=float, default=60.0, help="seconds of steady state per case")
    p.add_argument("--jobs", type=int, default=10, help="then J jobs x --job-nodes on one etcd (0: skip)")
    p.add_argument("--job-nodes", type=int, default=100)
    p.add_argument("--name", default="scale")
    p.add_argument(
        "--only",
        choices=["join", "failure"],
        default=None,
        help="join: only the join of each case; failure: per case the join, then the failure round "
        "(no steady state or status)",
    )
    p.add_argument("--profile", default="", help="a directory: each node process samples its join there")
    p.add_argument(
        "--trials",
        type=int,
        default=1,
        help="with --only join (or failure): joins (failure rounds) per case, each on a fresh etcd; "
        "the case reports the middle one by latency (the median for an odd count) and every "
        "trial's",
    )
    p.add_argument(
        "--lease-ttl", default="", help="every node's lease_ttl in seconds (default: the handler's)"
    )
    p.add_argument(
        "--ckpt-ports",
        action="store_true",
        help="every simulated node serves a checkpoint port, as agents do: the peer probe runs, "
        "and a killed node's refused port revokes its lease (rendezvous/dead_peers.py)",
    )
    args = p.parse_args()
    if args.lease_ttl:
        os.environ["ERM_SCALE_LEASE_TTL"] = args.lease_ttl  # read by child.py for every node process
    if args.ckpt_ports:
        os.environ["ERM_SCALE_CKPT_PORTS"] = "1"
    load_start = os.getloadavg()
    join_only = args.only == "join"
    log_dir = tempfile.mkdtemp(prefix="erm-scale-logs-")
    cases: dict = {}

    def case(name: str, run) -> None:
        """One case; a case that fails (etcd gone) is recorded as such, and the others still run."""
        try:
            cases[name] = run()
        except Exception as exc:  # noqa: BLE001 - recorded in the result
            cases[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "join": {"latency_s": None}}
            print(f"{name}: failed: {cases[name]['error']}", flush=True)

    shapes = [(f"N={n}", n, 1) for n in [int(s) for s in args.sizes.split(",") if s]]
    if args.jobs:
        shapes.append((f"{args.jobs}x{args.job_nodes}", args.job_nodes, args.jobs))
    if args.trials > 1 and args.only is None:
        p.error("--trials needs --only join or --only failure (a steady state per trial would take hours)")
    failures = args.trials > 1 and args.only == "failure"
    for name, n, jobs in shapes:
        if args.trials > 1 and join_only:
            case(
                name,
                lambda n=n, jobs=jobs: join_trials(n, jobs, args.procs, log_dir, args.trials, args.profile),
            )
            continue

        def one(n=n, jobs=jobs) -> dict:
            if failures:
                return failure_trials(n, jobs, args.procs, log_dir, args.trials)
            return run_case(
                n,
                jobs,
                args.procs,
                args.steady,
                True,
                log_dir,
                join_only,
                args.profile,
                args.only == "failure",
            )

        case(name, one)
        if args.ckpt_ports and not join_only:  # the baseline: the same failure with no port to refuse
            del os.environ["ERM_SCALE_CKPT_PORTS"]
            case(
                f"{name}-ttl-only",
                lambda n=n, jobs=jobs: failure_trials(n, jobs, args.procs, log_dir, max(1, args.trials)),
            )
            os.environ["ERM_SCALE_CKPT_PORTS"] = "1"
    ratios = {}
    base = cases.get("N=128", {}).get("join", {}).get("latency_s")
    for name, c in cases.items():
        lat = c["join"]["latency_s"]
        if base and lat and not name.endswith("ttl-only"):
            ratios[f"join.{name}/N=128"] = lat / base
        ttl_only = cases.get(f"{name}-ttl-only", {}).get("failure", {}).get("latency_s")
        if ttl_only and (fail := c.get("failure", {}).get("latency_s")):
            ratios[f"failure.{name}/ttl-only"] = fail / ttl_only
    payload = {
        "config": vars(args),
        "cases": cases,
        "ratios": ratios,
        "load_avg_at_end": os.getloadavg(),
        "load_avg_at_start": load_start,
        "logs": log_dir,
    }
    path = write_result(args.name, payload)
    for name, c in cases.items():
        if "error" in c:
            print(f"{name}: {c['error']}")
            continue
        if join_only:
            each = [t["latency_s"] for t in c["join"].get("trials", [])]
            print(
                f"{name}: join {c['join']['latency_s']} s"
                + (f" (median of {each})" if each else "")
                + f"; fan-out {c['join']['fanout_s']}"
            )
            continue
        if "steady" not in c:
            print(f"{name}: join {c['join']['latency_s']} s; failure {c['failure']['latency_s']} s")
            continue
        s = c["steady"]
        print(
            f"{name}: join {c['join']['latency_s']} s; leader {s['leader_cores']} cores; etcd "
            f"{s['etcd_writes_per_s']:.0f} writes/s; db {s['db_bytes_end']}; status "
            f"{c['status']['status_s']['median']:.3f} s"
        )
    print(f"ratios: {ratios}\nwrote {path}")


if __name__ == "__main__":
    main()
