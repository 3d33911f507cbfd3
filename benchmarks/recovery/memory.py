"""Memory over many rounds in place: does a kept worker grow round after round?

Two nodes (``ermrun``, one worker each) train the example TorchRec DLRM with ``--in-place``; then, cycle
after cycle, a third node arrives (a planned scale-up 2 -> 3: the two workers drain and keep their
processes) and, once a checkpoint of the world of 3 is committed, is lost (SIGKILL to its agent, spare and
worker: the two survivors' collectives fail, they hold the failure and rejoin the round of two in place,
restoring the newest committed checkpoint, the lost node's shards from its replica). ``--rounds 20`` makes
10 such cycles. After each round, once the new world trained
``--steps`` steps, the benchmark samples the resident memory (RSS, psutil) of each kept worker, of the two
agents and of their waiting warm spares.

Baselines in the same run: each kept worker's RSS after its first round (the same process, before any
round in place), and the RSS of a worker in a new process at the same point of its round (the joining
node's worker, new in every cycle: what a restart would hold). Growth: the last round's RSS over the
first's, in %; target: at most 5 %. Writes benchmarks/results/recovery-memory.json with the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from benchmarks.common import end_run, summarize, write_result
from benchmarks.recovery.__main__ import progress, start_node
from elastic_rm.agent.malloc import DEFAULT_ARENAS
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.proc import signal_tree

TARGET_GROWTH = 5.0  # the target: % of the first round's RSS
PRELOAD = "torch,torchrec,torchrec.models.dlrm,elastic_rm.train"


def rss(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def detail(pid: int) -> dict | None:
    """Where a worker's resident memory is: anonymous vs file/shared pages (``/proc/<pid>/status``), and
    how many files of node memory (/dev/shm) it maps."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = {
                k: v.split()[0] for k, _, v in (line.partition(":") for line in fh) if k.startswith("Rss")
            }
        with open(f"/proc/{pid}/maps") as fh:
            shm = sum(1 for line in fh if "/dev/shm/" in line)
    except OSError:
        return None
    return {
        "rss_anon_kib": int(status.get("RssAnon", 0)),
        "rss_file_kib": int(status.get("RssFile", 0)),
        "rss_shmem_kib": int(status.get("RssShmem", 0)),
        "shm_maps": shm,
    }


def spare_rss(agent_pid: int, workers: set[int]) -> list[int]:
    """RSS of each waiting spare under an agent (a spare.py process that is no round's worker)."""
    out = []
    try:
        children = psutil.Process(agent_pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            if p.pid not in workers and any(a.endswith("agent/spare.py") for a in p.cmdline()):
                out.append(p.memory_info().rss)
        except psutil.Error:
            pass
    return out


def wait_round(
    workdir: Path, world: int, since: float, steps: int, limit: float, committed: bool = False
) -> dict[int, dict] | None:
    """The new round's ``start`` row per rank once every rank of ``world`` trained ``steps`` steps after
    it and, with ``committed``, a checkpoint of it is committed (None: not within ``limit`` s)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        rows = progress(workdir)
        starts = {r["rank"]: r for r in rows if r.get("start") and r["t"] > since and r["world"] == world}
        if len(starts) == world:
            t0 = max(s["t"] for s in starts.values())
            done = {r["rank"] for r in rows if "step" in r and r["world"] == world and r["t"] > t0}
            counts = [
                sum(1 for r in rows if "step" in r and r["rank"] == k and r["world"] == world and r["t"] > t0)
                for k in range(world)
            ]
            saved = not committed or any(
                "committed_step" in r and r["world"] == world and r["t"] > t0 for r in rows
            )
            if done >= set(range(world)) and min(counts) >= steps and saved:
                return starts
        time.sleep(0.2)
    return None


def growth(first: int | None, last: int | None) -> float | None:
    return round(100.0 * (last - first) / first, 2) if first and last else None


def run(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="erm-memory-"))
    run_id = f"mem-{uuid.uuid4().hex[:8]}"
    etcd = EtcdServer().start()
    extra = ["--spares", "on", "--spare-preload", PRELOAD, "--malloc-arenas", str(args.malloc_arenas)]
    if args.probe:  # memory_probe/sitecustomize.py in every process; its dumps stall them: a longer lease
        os.makedirs(args.probe, exist_ok=True)
        os.environ.update(ERM_MEMDIAG_DIR=args.probe, PYTHONPATH=str(Path(__file__).parent / "memory_probe"))
        extra += ["--rdzv-conf", "lease_ttl=10"]

    def node(i: int):
        return start_node(
            "ermrun", workdir, etcd.endpoint, run_id, i, extra=extra, script_extra=["--in-place"]
        )

    kept = [node(0), node(1)]
    procs = list(kept)
    rounds: list[dict] = []
    try:
        starts = wait_round(workdir, 2, 0.0, args.steps, 240)
        if starts is None:
            return {"ok": False, "error": "never trained at world 2", "workdir": str(workdir)}
        pids = {s["node"]: s["pid"] for s in starts.values()}  # n0, n1: the workers to keep

        def sample(index: int, kind: str, starts: dict[int, dict]) -> dict:
            by_node = {s["node"]: s for s in starts.values()}
            kept_ok = all(by_node.get(n, {}).get("pid") == p for n, p in pids.items())
            new = [s["pid"] for n, s in by_node.items() if n not in pids]
            workers = {s["pid"] for s in starts.values()}
            return {
                "round": index,
                "kind": kind,
                "t": time.time(),
                "world": len(starts),
                "kept_same_pids": kept_ok,
                "in_place": {n: bool(s.get("in_place")) for n, s in by_node.items()},
                "worker_rss": {n: rss(p) for n, p in pids.items()},
                "worker_detail": {n: detail(p) for n, p in pids.items()},
                "new_worker_rss": rss(new[0]) if new else None,
                "agent_rss": {f"n{i}": rss(p.pid) for i, p in enumerate(kept)},
                "spare_rss": {f"n{i}": spare_rss(p.pid, workers) for i, p in enumerate(kept)},
                "loadavg": os.getloadavg(),
            }

        def probe(index: int) -> None:
            if args.probe:  # every process writes where its memory is (memory_breakdown.py reads it)
                (Path(args.probe) / "trigger").write_text(str(index))
                time.sleep(12)

        rounds.append(sample(0, "first", starts))
        probe(0)
        for k in range(args.rounds // 2):
            t0 = time.time()
            joiner = node(2 + k)
            procs.append(joiner)
            # a committed (replicated) checkpoint of world 3 before the joiner is lost: its shards must
            # survive it (benchmarks.recovery part a waits the same way)
            starts = wait_round(workdir, 3, t0, args.steps, args.limit, committed=True)
            if starts is None:
                return {
                    "ok": False,
                    "error": f"cycle {k}: no round of 3",
                    "rounds": rounds,
                    "workdir": str(workdir),
                }
            rounds.append(sample(len(rounds), "scale-up", starts))
            probe(len(rounds) - 1)
            t1 = time.time()
            signal_tree(joiner.pid, signal.SIGKILL)  # the node is lost: its agent, spare and worker
            starts = wait_round(workdir, 2, t1, args.steps, args.limit)
            if starts is None:
                return {
                    "ok": False,
                    "error": f"cycle {k}: no round of 2",
                    "rounds": rounds,
                    "workdir": str(workdir),
                }
            rounds.append(sample(len(rounds), "node-lost", starts))
            probe(len(rounds) - 1)
            print(
                f"round {len(rounds) - 1:2d}: kept workers "
                + ", ".join(f"{n} {v / 2**20:.0f} MiB" for n, v in rounds[-1]["worker_rss"].items() if v)
                + (
                    f"; new worker {rounds[-2]['new_worker_rss'] / 2**20:.0f} MiB"
                    if rounds[-2]["new_worker_rss"]
                    else ""
                ),
                flush=True,
            )
        return {"ok": True, "rounds": rounds}
    finally:
        end_run(procs, etcd, run_id, None if args.keep else workdir)


def summary(rounds: list[dict]) -> dict:
    first, last = rounds[0], rounds[-1]
    per_node = {}
    for n in first["worker_rss"]:
        series = [r["worker_rss"][n] for r in rounds if r["worker_rss"][n]]
        per_node[n] = {
            "first_mib": first["worker_rss"][n] / 2**20 if first["worker_rss"][n] else None,
            "last_mib": last["worker_rss"][n] / 2**20 if last["worker_rss"][n] else None,
            "max_mib": max(series) / 2**20 if series else None,
            "growth_pct": growth(first["worker_rss"][n], last["worker_rss"][n]),
            # the same rounds' kind only (after a node was lost, world 2), so the world size cancels out
            "growth_same_world_pct": growth(rounds[2]["worker_rss"][n], last["worker_rss"][n])
            if len(rounds) > 2
            else None,
        }
    new = [r["new_worker_rss"] / 2**20 for r in rounds if r["new_worker_rss"]]
    agents = {
        n: {
            "first_mib": first["agent_rss"][n] / 2**20,
            "last_mib": last["agent_rss"][n] / 2**20,
            "growth_pct": growth(first["agent_rss"][n], last["agent_rss"][n]),
        }
        for n in first["agent_rss"]
        if first["agent_rss"][n] and last["agent_rss"][n]
    }
    spares = {
        n: summarize([v / 2**20 for r in rounds for v in r["spare_rss"][n]]) for n in first["spare_rss"]
    }
    worst = max((v["growth_pct"] for v in per_node.values() if v["growth_pct"] is not None), default=None)
    return {
        "rounds_in_place": sum(1 for r in rounds[1:] if r["kept_same_pids"]),
        "kept_workers": per_node,
        "worst_growth_pct": worst,
        "new_process_worker_mib": summarize(new),
        "kept_vs_new_process": {
            n: v["last_mib"] / summarize(new)["median"] if new and v["last_mib"] else None
            for n, v in per_node.items()
        },
        "agents": agents,
        "spares_mib": spares,
        "target_growth_le_5pct": worst is not None and worst <= TARGET_GROWTH,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rounds", type=int, default=20, help="rounds in place after the first (even; default 20)"
    )
    p.add_argument("--steps", type=int, default=20, help="steps each round trains before it is sampled")
    p.add_argument("--limit", type=float, default=120.0, help="seconds to wait for each round (default 120)")
    p.add_argument(
        "--malloc-arenas",
        type=int,
        default=DEFAULT_ARENAS,
        help=f"ermrun --malloc-arenas of the nodes (default {DEFAULT_ARENAS}, ermrun's; 0: glibc's default)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, progress rows)")
    p.add_argument(
        "--probe",
        default=None,
        help="diagnostics: every process dumps where its memory is into this directory after each round "
        "(memory_probe/; then python -m benchmarks.recovery.memory_breakdown DIR); slows the run",
    )
    p.add_argument("--name", default="recovery-memory", help="results file name")
    args = p.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        raise SystemExit("--rounds: give an even number >= 2 (each cycle is a scale-up and a node lost)")
    load_before = os.getloadavg()
    result = run(args)
    payload = {
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "config": vars(args),
        **result,
    }
    if result["ok"]:
        payload["summary"] = summary(result["rounds"])
    path = write_result(args.name, payload)
    if result["ok"]:
        s = payload["summary"]
        for n, v in s["kept_workers"].items():
            print(f"kept worker {n}: {v['first_mib']} -> {v['last_mib']} MiB ({v['growth_pct']}%)")
        print(
            f"new-process worker (baseline): median {s['new_process_worker_mib']['median']:.0f} MiB; "
            f"rounds in place {s['rounds_in_place']}/{len(result['rounds']) - 1}; "
            f"target <= {TARGET_GROWTH:.0f}%: {'met' if s['target_growth_le_5pct'] else 'NOT met'}"
        )
    else:
        print("failed:", result.get("error"))
    print("wrote", path)


if __name__ == "__main__":
    main()
