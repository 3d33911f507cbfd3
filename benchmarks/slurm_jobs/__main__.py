"""Run the live multi-job benchmark (benchmarks/slurm_jobs/__init__.py): python -m benchmarks.slurm_jobs."""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
from benchmarks.slurm_jobs.trace import NODES, STEP_S, TRACE, TraceJob, requested_load
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.obs.events import Event, read_etcd
from elastic_rm.proc import kill_tree
from elastic_rm.wire.keyspace import Keyspace
from tests.slurm.cluster import SlurmCluster, why_not

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = os.path.dirname(PY)
CONF = "lease_ttl=10,last_call_timeout=1,join_timeout=600"  # a long lease: 2 cores shared with other work
POLL_S = 0.25
ROUND_PAUSE_BEGINS_S = 30.0  # a round's drain stops the old world's steps within this after its decision
# a gap between two steps longer than this is a pause (a round's, mostly): a step takes at most STEP_S (one
# node), plus noise, and the progress file is read every POLL_S
STALL_S = 1.5 * STEP_S
TARGET_MEAN, TARGET_PER_JOB = 0.8, 1.10
POLICIES = ("static", "elastic")
EMULATION_OFF = {
    "oom_horizon_s": 1.0,
    "oom_threshold": 1000.0,
    "mem_growth_horizon_s": 0.0,
    "straggler_k": 1000.0,
    "straggler_clear_k": 999.0,
}


def training_args(job: TraceJob, state: Path) -> list[str]:
    return [
        "examples/emulated/train.py",
        "--samples",
        str(job.samples),
        "--step-s",
        str(STEP_S),
        "--curve",
        job.curve,
        "--noise",
        "0.05",
        "--state",
        str(state),
    ]


def job_description(job: TraceJob, run_id: str) -> dict:
    desc = json.loads((REPO / "examples" / "emulated" / "job.json").read_text())
    desc["name"] = run_id
    desc["request"] = {"nodes": job.nodes}
    # the emulated nodes share one machine: its memory and CPU are every node's, so the planner's memory
    # rules (OOM forecast, memory floor) and busy-time straggler rules would read the other jobs' load
    # (a first run asked for all 8 nodes for a 1-node job: "memory floor"); they are off here
    desc["planner"].update(EMULATION_OFF)
    return desc


def static_script(job: TraceJob, etcd, run_id: str, work: Path) -> str:
    """``srun ermrun`` at the requested size, as users run torchrun in an allocation; the end time and exit
    status go to ``done``."""
    ermrun = [
        PY,
        "-m",
        "launcher.ermrun",
        "--nnodes",
        f"{job.nodes}:{job.nodes}",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        *training_args(job, work / "state"),
    ]
    return (
        "#!/bin/sh\n"
        f"srun --kill-on-bad-exit=1 {shlex.join(ermrun)}\n"
        f'echo "$? $(date +%s.%N)" > {shlex.quote(str(work / "done"))}\n'
    )


def elastic_command(job: TraceJob, etcd, run_id: str, work: Path, call_in: bool = True) -> str:
    argv = [
        os.path.join(BIN, "erm"),
        "launch",
        "--slurm",
        *(["--call-in"] if call_in else []),  # the progress file outlives the nodes
        "--slurm-output",
        str(work / "%x-%j.out"),
        "--workdir",
        str(REPO),
        "--poll-interval",
        "1",
        "--stop-grace",
        "15",
        "--pending-report",
        "600",
        "--job",
        str(work / "job.json"),
        "--nnodes",
        f"1:{NODES}",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        *training_args(job, work / "state"),
    ]
    log, done = shlex.quote(str(work / "launch.log")), shlex.quote(str(work / "done"))
    return f'{shlex.join(argv)} > {log} 2>&1; echo "$? $(date +%s.%N)" > {done}'


class PolicyRun:
    """One policy over the trace on its own cluster: submits each job at its arrival, records its first
    step, its end, the pauses between its steps, and the nodes Slurm gives it (sampled from squeue)."""

    def __init__(
        self,
        policy: str,
        cluster: SlurmCluster,
        etcd,
        root: Path,
        tag: str,
        count: int,
        t0: float,
        call_in: bool = True,
    ):
        self.policy, self.cluster, self.etcd, self.root = policy, cluster, etcd, root
        self.call_in = call_in  # erm launch --call-in for the elastic jobs
        self.tag, self.count, self.t0 = tag, count, t0  # count: the jobs of the trace; t0: the trace's start
        self.jobs: dict[str, dict] = {}
        self.procs: list[subprocess.Popen] = []
        self.slurm_ids: list[str] = []

    def submit(self, job: TraceJob, t0: float) -> None:
        run_id = f"{self.policy[:2]}{self.tag}-{job.name}-{uuid.uuid4().hex[:4]}"
        work = self.root / job.name
        work.mkdir(parents=True)
        row = {
            "run_id": run_id,
            "work": work,
            "arrival": time.time(),
            "trace_submit_s": job.submit_s,
            "start": None,
            "end": None,
            "rc": None,
            "node_s": 0.0,
            "max_nodes": 0,
            "sizes": [],  # [seconds from the trace's start, nodes held] at each change (squeue)
            "stalls": [],  # [seconds from the trace's start, seconds] of each pause between two steps
            "last_step": None,  # the time of the last step seen in the progress file
            "submit_lag_s": time.time() - t0 - job.submit_s,
        }
        if self.policy == "static":
            (work / "job.sh").write_text(static_script(job, self.etcd, run_id, work))
            r = self.cluster.cmd(
                "sbatch",
                "--parsable",
                "-N",
                str(job.nodes),
                "--exclusive",
                "-J",
                run_id,
                f"--chdir={REPO}",
                f"--output={work / 'job.out'}",
                str(work / "job.sh"),
                check=False,
            )
            if r.returncode != 0:
                raise RuntimeError(f"sbatch of {job.name} failed: {r.stderr.strip()}")
            self.slurm_ids.append(r.stdout.strip().split(";")[0])
        else:
            (work / "job.json").write_text(json.dumps(job_description(job, run_id)))
            p = subprocess.Popen(
                ["sh", "-c", elastic_command(job, self.etcd, run_id, work, self.call_in)],
                env=self.cluster.env(),
                cwd=work,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.procs.append(p)
        self.jobs[job.name] = row

    def observe(self, dt: float) -> None:
        """First steps and ends from the jobs' files; node-seconds from squeue's running jobs."""
        now = time.time()
        for row in self.jobs.values():
            progress = row["work"] / "state" / "progress.json"
            if row["start"] is None and progress.exists():
                row["start"] = now
            self.record_step(row, progress)
            done = row["work"] / "done"
            if row["end"] is None and done.exists():
                parts = done.read_text().split()
                if len(parts) == 2:
                    row["rc"], row["end"] = int(parts[0]), float(parts[1])
        r = self.cluster.cmd("squeue", "-h", "-t", "R", "-o", "%j %D", check=False)
        held: dict[str, int] = {}
        for line in r.stdout.splitlines():
            name, _, count = line.partition(" ")
            held[name] = held.get(name, 0) + int(count or 0)
        for row in self.jobs.values():
            n = held.get(row["run_id"], 0) + held.get(f"erm-{row['run_id']}", 0)
            row["node_s"] += n * dt
            row["max_nodes"] = max(row["max_nodes"], n)
            if (row["sizes"][-1][1] if row["sizes"] else 0) != n:
                row["sizes"].append([round(now - self.t0, 1), n])

    def record_step(self, row: dict, progress: Path) -> None:
        """The job's pauses: rank 0 writes each step's time to the progress file; a gap of more than
        STALL_S between two steps seen is a pause (a round's drain and restart, or a node's start)."""
        try:
            t = float(json.loads(progress.read_text())["time"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # not written yet, or read while replaced
        last = row["last_step"]
        if last is not None and t - last > STALL_S:
            row["stalls"].append([round(last - self.t0, 2), round(t - last, 2)])
        row["last_step"] = t

    def finished(self) -> bool:
        return len(self.jobs) == self.count and all(r["end"] is not None for r in self.jobs.values())

    def stop(self) -> None:
        """Every erm launch by its pid (SIGTERM: it stops its node jobs), then anything Slurm still has."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
        self.cluster.reset(60)
        for row in self.jobs.values():
            shutil.rmtree(Path("/dev/shm/elastic-rm") / row["run_id"], ignore_errors=True)

    def rows(self) -> dict[str, dict]:
        """Per job its figures, and when it arrived, first stepped and ended (seconds from the trace's
        start), the nodes it held over time, and whom it waited for (queue_order)."""
        out = {}
        for name, row in self.jobs.items():
            jct = row["end"] - row["arrival"] if row["end"] is not None else None
            queue = row["start"] - row["arrival"] if row["start"] is not None else None
            out[name] = {
                "jct_s": jct,
                "queue_s": queue,
                "node_s": row["node_s"],
                "max_nodes": row["max_nodes"],
                "rc": row["rc"],
                "submit_lag_s": row["submit_lag_s"],
                "arrival_s": row["arrival"] - self.t0,
                "start_s": None if row["start"] is None else row["start"] - self.t0,
                "end_s": None if row["end"] is None else row["end"] - self.t0,
                "sizes": row["sizes"],
                "stalls": row["stalls"],
                **({"decisions": row["decisions"]} if "decisions" in row else {}),
            }
        for name, row in out.items():
            row.update(queue_order(name, out))
            rounds = [d for d in row.get("decisions", ()) if d["kind"] == "round"]
            for i, d in enumerate(rounds):
                later = rounds[i + 1]["t"] if i + 1 < len(rounds) else None
                d["downtime_s"] = round_downtime(d["t"], later, row["stalls"])
        return out


def round_downtime(decided: float, next_decided: float | None, stalls: list[list[float]]) -> float | None:
    """A round's pause: the first pause between two steps that began from a step before the round's
    decision (the drain stops the old world at a step boundary) to ROUND_PAUSE_BEGINS_S after it, and
    before the next round's decision; None for a round that paused no step for longer than STALL_S (the
    job's first round, which had no step before it, or a round whose pause was shorter)."""
    until = decided + ROUND_PAUSE_BEGINS_S
    if next_decided is not None:
        until = min(until, next_decided - STEP_S)
    for start, seconds in stalls:
        if decided - STEP_S <= start < until:
            return seconds
    return None


def queue_order(name: str, rows: dict[str, dict]) -> dict:
    """Whom a job waited for: the jobs that held nodes while it queued (arrival to first step), the jobs
    that arrived after it and stepped before it (they overtook it: a backfill, or a smaller start that fit
    the free nodes), and the earlier arrivals it overtook. A job that never stepped waited to the end."""
    me = rows[name]
    until = me["start_s"] if me["start_s"] is not None else float("inf")

    def held_between(other: dict, t0: float, t1: float) -> bool:
        sizes = other["sizes"]
        if t1 <= t0:
            return False  # it did not wait
        for i, (t, n) in enumerate(sizes):
            t_next = sizes[i + 1][0] if i + 1 < len(sizes) else float("inf")
            if n > 0 and t < t1 and t_next > t0:
                return True
        return False

    def started_before(other: dict, t: float) -> bool:
        return other["start_s"] is not None and other["start_s"] < t

    others = {n: r for n, r in rows.items() if n != name}
    return {
        "waited_for": sorted(n for n, r in others.items() if held_between(r, me["arrival_s"], until)),
        "overtaken_by": sorted(
            n for n, r in others.items() if r["arrival_s"] > me["arrival_s"] and started_before(r, until)
        ),
        "overtook": sorted(
            n
            for n, r in others.items()
            if r["arrival_s"] < me["arrival_s"]
            and me["start_s"] is not None
            and not started_before(r, me["start_s"])
        ),
    }


def give_backs(events: list[Event], arrivals: list[float]) -> list[dict]:
    """The path by which a grown run gives nodes back to a queue, from its events: each spell in which the
    run's queue key is above 0 (from the executor's first such ``queue`` event, which is the run's first
    when it starts while others wait), how long since another run last submitted its first node job
    (``arrivals``: squeue's refresh and the queue key's write), to the leader's next
    smaller demand (``demand``), to the launcher's stop of a node the round no longer uses (the drain) and
    to that node job's end in Slurm. ``given_back`` False: the queue emptied first (or the run ended)
    without a smaller demand."""
    out, chain, demand = [], None, None
    for e in events:
        d, action = e.data, e.data.get("action")
        if e.kind == "launch" and action == "queue":
            waiting = d.get("waiting_nodes", 0)
            if waiting > 0 and chain is None:
                before = [a for a in arrivals if a <= e.time]
                chain = {"t": e.time, "waiting_nodes": waiting, "demand_before": demand, "given_back": False}
                chain["since_submit_s"] = e.time - max(before) if before else None
            elif waiting == 0 and chain is not None:
                out.append(chain)
                chain = None
        elif e.kind == "demand":
            new = d.get("target_nodes")
            if chain is not None and "decision_s" not in chain and demand and new and new < demand:
                chain.update(decision_s=e.time - chain["t"], demand_after=new, t_decision=e.time)
            demand = new
        elif e.kind == "launch" and action == "stop" and chain is not None and "t_decision" in chain:
            if "drain_s" not in chain and "neither uses" in d.get("reason", ""):
                chain.update(drain_s=e.time - chain["t_decision"], job=d.get("job"), t_stop=e.time)
        elif e.kind == "launch" and action == "stopped" and chain is not None and "t_stop" in chain:
            if d.get("job") == chain["job"] and "ended_s" not in chain:
                chain.update(ended_s=e.time - chain["t_stop"], given_back=True)
                chain["total_s"] = e.time - chain["t"]
    if chain is not None:
        out.append(chain)
    for c in out:
        c.pop("t_decision", None)
        c.pop("t_stop", None)
    return out


def decisions(events: list[Event], t0: float) -> list[dict]:
    """An elastic job's decisions that cost or gained it time, in order (seconds from the trace's start):
    its rounds (size, reason; rows() adds each round's pause), the leader's demands, and its launcher's
    actions (node jobs submitted, running, held, stopped; the queue key)."""
    out = []
    for e in events:
        d, t = e.data, round(e.time - t0, 2)
        if e.kind == "decision" and isinstance(d.get("round"), int):
            out.append(
                {
                    "t": t,
                    "kind": "round",
                    "round": d["round"],
                    "nodes": d.get("world"),
                    "reason": d.get("reason"),
                }
            )
        elif e.kind == "demand":
            out.append({"t": t, "kind": "demand", "nodes": d.get("target_nodes"), "reason": d.get("reason")})
        elif e.kind == "launch":
            # a run's first node jobs are submitted before the launcher's executor reports them
            at = d.get("submitted_at")
            row = {
                "t": round(at - t0, 3) if at is not None else t,
                "kind": "launch",
                "action": d.get("action"),
            }
            for key in ("node", "job", "waiting_nodes", "target_nodes"):
                if d.get(key) is not None:
                    row[key] = d[key]
            out.append(row)
    # in time order: a run's first node jobs are reported once erm launch has loaded ermrun's parser,
    # after the leader's first events when its nodes started faster than that
    return sorted(out, key=lambda row: row["t"])


def collect_give_backs(etcd, run: PolicyRun, t0: float) -> dict[str, list[dict]]:
    """Per elastic job, its give-back chains (give_backs), times from the round's start; its decisions
    (decisions) go into its row of ``run``'s jobs."""
    with EtcdClient(etcd.endpoint) as client:
        events = {n: read_etcd(client, Keyspace("/elastic-rm", r["run_id"]))[0] for n, r in run.jobs.items()}
    for name, evs in events.items():
        run.jobs[name]["decisions"] = decisions(evs, t0)
    first_submit = {
        n: min(
            (
                e.data.get("submitted_at", e.time)
                for e in evs
                if e.kind == "launch" and e.data.get("action") == "submit"
            ),
            default=None,
        )
        for n, evs in events.items()
    }
    out = {}
    for name, evs in events.items():
        others = [t for n, t in first_submit.items() if n != name and t is not None]
        chains = give_backs(evs, others)
        for c in chains:
            c["t"] -= t0
        out[name] = chains
    return out


def give_back_summary(rounds: list[dict]) -> dict:
    """Medians and maxima of each stage over every give-back of every round; how many queues got none."""
    chains = [c for r in rounds for job in r.get("give_backs", {}).values() for c in job]
    done = [c for c in chains if c["given_back"]]
    out = {"queued_while_running": len(chains), "given_back": len(done)}
    for stage in ("since_submit_s", "decision_s", "drain_s", "ended_s", "total_s"):
        values = [
            c[stage] for c in (done if stage != "since_submit_s" else chains) if c.get(stage) is not None
        ]
        if values:
            out[stage] = {"median": statistics.median(values), "max": max(values), "n": len(values)}
    return out


def run_round(
    etcds: dict,
    clusters: dict[str, SlurmCluster],
    root: Path,
    tag: str,
    timeout_s: float,
    trace,
    call_in: bool = True,
) -> dict:
    """Both policies at once over the trace; returns per policy its job rows, and the load averages."""
    t0 = last = time.time()
    runs = {p: PolicyRun(p, clusters[p], etcds[p], root / p, tag, len(trace), t0, call_in) for p in POLICIES}
    pending = sorted(trace, key=lambda j: j.submit_s)
    loads: list[float] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while not all(r.finished() for r in runs.values()):
            if time.monotonic() > deadline:
                timed_out = True
                break
            now = time.time()
            while pending and now - t0 >= pending[0].submit_s:
                job = pending.pop(0)
                for run in runs.values():
                    run.submit(job, t0)
                print(f"  [{now - t0:6.0f} s] {job.name} arrives ({job.kind}, asks {job.nodes})", flush=True)
            for run in runs.values():
                run.observe(now - last)
            last = now
            if not loads or len(loads) < (now - t0) / 10:
                loads.append(os.getloadavg()[0])
            time.sleep(POLL_S)
    finally:
        for run in runs.values():
            run.stop()
    return {
        "give_backs": collect_give_backs(etcds["elastic"], runs["elastic"], t0),  # before rows: decisions
        "jobs": {p: r.rows() for p, r in runs.items()},
        "load_avg_1m": loads,
        "timed_out": timed_out,
        "wall_s": time.time() - t0,
    }


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summary(rounds: list[dict], trace) -> dict:
    """Per job: its JCT under each policy (mean over rounds) and the ratio; means and queueing per policy."""
    per_job = {}
    for job in trace:
        row = {"kind": job.kind, "asks": job.nodes}
        for p in POLICIES:
            jcts = [r["jobs"][p][job.name]["jct_s"] for r in rounds if job.name in r["jobs"][p]]
            done = [j for j in jcts if j is not None]
            row[f"{p}_jct_s"] = mean(done) if len(done) == len(rounds) else None
            row[f"{p}_queue_s"] = mean([r["jobs"][p][job.name]["queue_s"] or 0.0 for r in rounds])
            row[f"{p}_node_s"] = mean([r["jobs"][p][job.name]["node_s"] for r in rounds])
            # per round, the jobs that started before it though they arrived after it
            row[f"{p}_overtaken_by"] = [r["jobs"][p][job.name].get("overtaken_by", []) for r in rounds]
        elastic = [r["jobs"]["elastic"][job.name] for r in rounds]
        changes = [[d for d in j.get("decisions", ()) if d["kind"] == "round"][1:] for j in elastic]
        row["elastic_rounds_after_first"] = mean([len(c) for c in changes])
        row["elastic_round_pauses_s"] = mean([sum(d["downtime_s"] or 0.0 for d in c) for c in changes])
        s, e = row["static_jct_s"], row["elastic_jct_s"]
        row["ratio"] = e / s if s and e else None
        row["ratios_per_round"] = [
            (r["jobs"]["elastic"][job.name]["jct_s"] or float("nan")) / r["jobs"]["static"][job.name]["jct_s"]
            for r in rounds
            if r["jobs"]["static"][job.name]["jct_s"]
        ]
        per_job[job.name] = row
    out = {"per_job": per_job}
    for p in POLICIES:
        jcts = [row[f"{p}_jct_s"] for row in per_job.values()]
        complete = all(j is not None for j in jcts)
        out[p] = {
            "mean_jct_s": mean(jcts) if complete else None,
            "median_jct_s": statistics.median(jcts) if complete else None,
            "mean_queue_s": mean([row[f"{p}_queue_s"] for row in per_job.values()]),
            "node_hours": sum(row[f"{p}_node_s"] for row in per_job.values()) / 3600,
            "completed_all": complete,
        }
    ratios = [row["ratio"] for row in per_job.values() if row["ratio"] is not None]
    if out["static"]["mean_jct_s"] and out["elastic"]["mean_jct_s"]:
        out["mean_jct_ratio"] = out["elastic"]["mean_jct_s"] / out["static"]["mean_jct_s"]
    else:
        out["mean_jct_ratio"] = None
    out["max_job_ratio"] = max(ratios) if ratios else None
    out["jobs_over_target"] = sorted(n for n, row in per_job.items() if (row["ratio"] or 0) > TARGET_PER_JOB)
    out["meets_target"] = bool(
        out["mean_jct_ratio"] is not None
        and out["mean_jct_ratio"] <= TARGET_MEAN
        and not out["jobs_over_target"]
        and len(ratios) == len(per_job)
    )
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=1, help="times the comparison runs (default 1)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="bound on each round's wall time")
    ap.add_argument("--jobs", type=int, default=len(TRACE), help="only the first N jobs of the trace (a try)")
    ap.add_argument("--name", default="slurm-jobs", help="results file benchmarks/results/<name>.json")
    ap.add_argument(
        "--no-call-in", action="store_true", help="the elastic jobs without erm launch's --call-in"
    )
    args = ap.parse_args()
    reason = why_not()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped benchmark stops its jobs and clusters too
    # every process of the run imports this checkout (a copy of the tree stays the same for the whole run)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    trace = TRACE[: args.jobs]
    print(f"{len(trace)} jobs, requested load {requested_load(trace):.2f} of {NODES} nodes", flush=True)
    root = Path(tempfile.mkdtemp(prefix="erm-bench-slurm-jobs-"))
    rounds = []
    try:
        with (
            EtcdServer() as etcd_a,
            EtcdServer() as etcd_b,
            SlurmCluster(NODES) as a,
            SlurmCluster(NODES) as b,
        ):
            clusters, etcds = {"static": a, "elastic": b}, {"static": etcd_a, "elastic": etcd_b}
            for i in range(args.rounds):
                print(f"round {i + 1} of {args.rounds}", flush=True)
                rounds.append(
                    run_round(
                        etcds,
                        clusters,
                        root / f"round{i}",
                        str(i),
                        args.timeout_s,
                        trace,
                        call_in=not args.no_call_in,
                    )
                )
                clusters = {"static": clusters["elastic"], "elastic": clusters["static"]}  # swap clusters
                etcds = {"static": etcds["elastic"], "elastic": etcds["static"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = summary(rounds, trace)
    result["give_back"] = give_back_summary(rounds)
    result["rounds"] = rounds
    loads = [x for r in rounds for x in r["load_avg_1m"]]
    result["load_avg_1m"] = {"mean": mean(loads), "max": max(loads, default=None)}
    result["config"] = {
        "nodes": NODES,
        "jobs": len(trace),
        "rounds": args.rounds,
        "step_s": STEP_S,
        "requested_load": requested_load(trace),
        "rdzv_conf": CONF,
        "call_in": not args.no_call_in,
        "targets": {"mean_jct_ratio": TARGET_MEAN, "per_job_ratio": TARGET_PER_JOB},
        "trace": [
            {
                "name": j.name,
                "submit_s": j.submit_s,
                "nodes": j.nodes,
                "kind": j.kind,
                "curve": j.curve,
                "minutes_at_request": j.minutes_at_request,
            }
            for j in trace
        ],
    }
    print(f"{'job':5} {'kind':6} {'asks':>4} {'static':>8} {'elastic':>8} {'ratio':>6}")
    for name, row in result["per_job"].items():
        s, e, q = row["static_jct_s"], row["elastic_jct_s"], row["ratio"]
        print(f"{name:5} {row['kind']:6} {row['asks']:>4} {s or 0:8.0f} {e or 0:8.0f} {q or 0:6.2f}")
    for p in POLICIES:
        x = result[p]
        print(
            f"{p}: mean JCT {x['mean_jct_s'] or 0:.0f} s, median {x['median_jct_s'] or 0:.0f} s, "
            f"mean queueing {x['mean_queue_s']:.0f} s, {x['node_hours']:.2f} node-hours"
        )
    print(
        f"mean JCT elastic / static: {result['mean_jct_ratio'] or 0:.2f}x (target {TARGET_MEAN}x); "
        f"worst job {result['max_job_ratio'] or 0:.2f}x (target {TARGET_PER_JOB}x); "
        f"load average {result['load_avg_1m']}"
    )
    print(f"give-backs to a queue (stage: median, max): {json.dumps(result['give_back'])}")
    print("wrote", write_result(args.name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
