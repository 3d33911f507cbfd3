"""What one malloc arena per worker costs a step (``ermrun --malloc-arenas``, elastic_rm/agent/malloc.py).

Two ``ermrun`` nodes (one worker each, warm spares, the example TorchRec DLRM with ``--in-place`` and its
flash checkpoint every 10 steps) train ``--steps`` steps, with the workers' ``MALLOC_ARENA_MAX`` at 1 (the
default) and, as the baseline in the same run, at glibc's default (``--malloc-arenas 0``: up to 8 arenas
per core). The two alternate, ``--trials`` times each, the order swapped every trial. For each run: the
median step time of each rank (consecutive progress rows, the first ``--warmup`` steps left out), the p90,
and each worker's last resident memory while it trained. Prints the ratio of the medians (one arena over
glibc's default) and writes benchmarks/results/recovery-arenas.json with the load average before and
after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from benchmarks.common import end_run, summarize, write_result
from benchmarks.recovery.__main__ import progress, start_node
from elastic_rm.etcd.server import EtcdServer

PRELOAD = "torch,torchrec,torchrec.models.dlrm,elastic_rm.train"
# each setting: its --malloc-arenas and the extra environment of the nodes
MODES = {
    "one-arena": (1, {}),
    "glibc-default": (0, {}),
    # glibc's dynamic mmap threshold fixed at 1 MiB: blocks above it are always mapped, and unmapped on free
    "mmap-threshold-1mib": (0, {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}),
}
BASELINE = "glibc-default"


def step_times(rows: list[dict], rank: int, warmup: int) -> list[float]:
    """Seconds between rank ``rank``'s consecutive steps after step ``warmup``."""
    steps = sorted((r["step"], r["t"]) for r in rows if "step" in r and r.get("rank") == rank)
    return [
        t1 - t0 for (s0, t0), (s1, t1) in zip(steps, steps[1:], strict=False) if s0 >= warmup and s1 == s0 + 1
    ]


def mean_median(run: dict) -> float | None:
    values = [v["median_s"] for v in run["ranks"].values() if v["median_s"]]
    return statistics.mean(values) if run["ok"] and values else None


def paired_ratios(runs: list[dict], baseline: list[dict]) -> dict:
    """Each trial's step time over the baseline's in the same trial (they ran back to back: the machine's
    drift between trials cancels out)."""
    pairs = [(mean_median(a), mean_median(b)) for a, b in zip(runs, baseline, strict=True)]
    return {
        **summarize([a / b for a, b in pairs if a and b]),
        "per_trial": [a / b if a and b else None for a, b in pairs],
    }


def one_run(arenas: int, env: dict[str, str], steps: int, warmup: int, limit: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="erm-arenas-"))
    run_id = f"arenas-{uuid.uuid4().hex[:8]}"
    etcd = EtcdServer().start()
    extra = ["--spares", "on", "--spare-preload", PRELOAD, "--malloc-arenas", str(arenas)]
    script = ["--in-place", "--steps", str(steps)]
    os.environ.update(env)
    procs = [
        start_node("ermrun", workdir, etcd.endpoint, run_id, i, nnodes="2", extra=extra, script_extra=script)
        for i in range(2)
    ]
    for key in env:
        del os.environ[key]
    rss: dict[int, int] = {}
    try:
        deadline = time.time() + limit
        while time.time() < deadline and any(p.poll() is None for p in procs):
            for r in progress(workdir):
                if r.get("start"):
                    try:
                        rss[r["rank"]] = psutil.Process(r["pid"]).memory_info().rss
                    except psutil.Error:
                        pass  # finished
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
        rows = progress(workdir)
        per_rank = {}
        for rank in (0, 1):
            times = step_times(rows, rank, warmup)
            per_rank[rank] = {
                "steps_timed": len(times),
                "median_s": statistics.median(times) if times else None,
                "p90_s": statistics.quantiles(times, n=10)[-1] if len(times) >= 10 else None,
                "last_rss_mib": rss[rank] / 2**20 if rank in rss else None,
            }
        ok = codes == [0, 0] and all(v["steps_timed"] >= steps - warmup - 1 for v in per_rank.values())
        return {"ok": ok, "exit_codes": codes, "ranks": per_rank}
    finally:
        end_run(procs, etcd, run_id, workdir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="runs of each setting (default 3)")
    p.add_argument("--steps", type=int, default=300, help="steps each run trains (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out of the timing (default 20)")
    p.add_argument("--limit", type=float, default=300.0, help="seconds each run may take (default 300)")
    p.add_argument("--name", default="recovery-arenas", help="results file name")
    p.add_argument(
        "--modes", default="one-arena,glibc-default", help=f"settings to compare, of {','.join(MODES)}"
    )
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for trial in range(args.trials):
        order = modes if trial % 2 == 0 else list(reversed(modes))
        for name in order:
            run = one_run(*MODES[name], args.steps, args.warmup, args.limit)
            runs[name].append(run)
            medians = [v["median_s"] for v in run["ranks"].values()]
            print(f"trial {trial} {name}: ok={run['ok']} step medians {medians}", flush=True)
    results = {}
    for name, trials in runs.items():
        good = [t for t in trials if t["ok"]]
        results[name] = {
            "ok_runs": len(good),
            "step_median_s": summarize([v["median_s"] for t in good for v in t["ranks"].values()]),
            "step_p90_s": summarize([v["p90_s"] for t in good for v in t["ranks"].values() if v["p90_s"]]),
            "worker_rss_mib": summarize(
                [v["last_rss_mib"] for t in good for v in t["ranks"].values() if v["last_rss_mib"]]
            ),
            "trials": trials,
        }
    ratios = {}
    if BASELINE in runs:
        for name in modes:
            if name != BASELINE:
                ratios[name] = paired_ratios(runs[name], runs[BASELINE])
    payload = {
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "config": vars(args),
        "results": results,
        "step_time_vs_glibc_default": ratios,
    }
    path = write_result(args.name, payload)
    for name in modes:
        r = results[name]
        print(
            f"{name}: median step {r['step_median_s']['median']}, p90 {r['step_p90_s']['median']}, "
            f"worker RSS {r['worker_rss_mib']['median']} MiB ({r['ok_runs']} runs)"
        )
    for name, r in ratios.items():
        print(f"step time, {name} / {BASELINE}, same trial: median {r['median']} (of {r['n']} trials)")
    print("wrote", path)


if __name__ == "__main__":
    main()
