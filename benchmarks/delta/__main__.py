"""Benchmark: differential flash checkpoints against full flash checkpoints, in one run.

    .venv/bin/python -m benchmarks.delta [--gib 1] [--zipf 1.1] [--modes full,delta]

A DLRM (8 tables, fused row-wise Adagrad, power-law ids) over 2 ranks (gloo, real processes, one
simulated node each, a checkpoint server process per node as ermrun's agents run). For each mode
(`full`: every save copies the whole state; `delta`: FlashConfig(differential=True)) and a
checkpoint every 1, 10 and 100 steps: the touched fraction, bytes copied / replicated / written per
checkpoint, the step pause, the training throughput against training without checkpoints, the
kinds of saves (a chain past its bound folds), node memory (the node directory's bytes at their
peak, as the checkpointer and each node's checkpoint server sample them, and after each interval);
then one save alone (its background time). Restores, at the same world and into world 3 (each timed
five times, the median kept): the full mode's newest step; in the differential mode, for each interval,
its own chain (a new base and a save every interval) once it holds 10 deltas, against a full save of
the same step restored in the same conditions (an interval whose chain folds before says so, with the
chain it held), and beside them a heavy case: a mixed chain (9 deltas of 1 step, 6 of 10, then
deltas of 100 steps) near its fold (ratios: "chain_restores"). Every restore is checked bit for bit.
Prints the ratios delta / full and writes benchmarks/results/<name>.json. The differential mode's
checkpoint-every-step run is longer (--delta-every-step-steps): its throughput is a target, and its
chain then passes a fold.

Memory: the full mode holds about 6x the state at its peak (the model, the snapshot buffers, the old
and the new step in node memory, the same for the peer's replica); the run refuses to start when the
machine's available memory is short of that, and says what --gib fits. The default, 1 GiB, fits a
24 GiB machine shared with other work; 4 GiB needs about 25 GiB free.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, write_result
from benchmarks.ranks import run_ranks
from elastic_rm.checkpoint.local_servers import NodeServer, node_servers, peer_lists

PEAK_FACTOR = 6  # peak memory of the full mode, in multiples of the state (module docstring)


def launch(spec: dict[str, Any], nprocs: int, timeout: float) -> list[list[dict[str, Any]]]:
    work = Path(spec["workdir"])
    mode = spec["mode"]
    path = work / f"spec-{mode}.json"
    path.write_text(json.dumps(spec))
    run_ranks("benchmarks.delta.worker", path, nprocs, timeout, lambda r: work / f"log-{mode}-{r}.txt", mode)
    return [json.loads((work / f"result-{mode}-{r}.json").read_text()) for r in range(nprocs)]


def store_peak(server: NodeServer) -> int | None:
    """The node directory's bytes at their largest as its checkpoint server sampled them (before each
    replica it published), from the server's step listing."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", "/v1/steps", headers={"Authorization": f"Bearer {server.token}"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"checkpoint server of {server.node}: GET /v1/steps: HTTP {resp.status}")
        return json.loads(resp.read()).get("peak_bytes")
    finally:
        conn.close()


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def chain_restores(delta: dict[str, Any]) -> dict[str, Any]:
    """Per chain (each interval's own, and the mixed one near its fold): its length, its bytes over its
    base's, and its restore over the restore of a full save of the same step, at the same world and
    into world 3; an interval whose chain folds before it holds enough deltas says so instead."""
    out: dict[str, Any] = {}
    for label, c in delta["train"].get("chains", {}).items():
        if "restore_chain" not in c:
            out[label] = {"restore": None, "folds_before_deltas": c.get("folds_before"), **c["before_fold"]}
            continue
        world3 = delta["restore"]["chains"][label]
        out[label] = {
            "deltas": c["deltas"],
            "bytes_over_base": c["bytes_over_base"],
            "node_bytes_over_base_max": c["node_bytes_over_base_max"],
            "same_world_s": c["restore_chain"]["s"],
            "same_world_full_s": c["restore_full"]["s"],
            "same_world_over_full": c["chain_over_full"],
            # where the chain's restore went (each part the median over the restores, slowest rank)
            "same_world_parts_s": c["restore_chain"]["parts_s"],
            "world3_parts_s": world3["chain"]["parts_s"],
            "world3_s": world3["chain"]["restore_s"],
            "world3_full_s": world3["full"]["restore_s"],
            "world3_over_full": ratio(world3["chain"]["restore_s"], world3["full"]["restore_s"]),
        }
    return out


def exact(mode: str, train: dict[str, Any], restore: dict[str, Any]) -> bool:
    """Every restore gave the state saved, bit for bit (the digests the train phase recorded)."""
    if mode == "full":
        ok = restore["digest"] == train["saved_digest"] and restore["step"] == train["saved_step"]
        return ok and train["restore_same_world_exact"]
    chains = {label: c for label, c in train.get("chains", {}).items() if "restore_chain" in c}
    ok = bool(chains)  # no chain restored: nothing was shown exact
    for label, c in chains.items():
        ok = ok and c["restore_chain"]["exact"] and c["restore_full"]["exact"]
        for kind in ("chain", "full"):
            got = restore["chains"][label][kind]
            ok = ok and got["digest"] == c["digest"] and got["step"] == c["step"]
    return ok


def compare(full: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """full / delta (how many times less the differential mode costs) per interval, and the targets."""
    out: dict[str, Any] = {"intervals": []}
    for f, d in zip(full["train"]["intervals"], delta["train"]["intervals"], strict=True):
        out["intervals"].append(
            {
                "interval": f["interval"],
                "touched_mean": d["touched"]["mean"],
                "replicated_less": ratio(f.get("bytes_replicated_mean"), d.get("bytes_replicated_mean")),
                "written_less": ratio(f.get("bytes_written_mean"), d.get("bytes_written_mean")),
                "copied_less": ratio(f["bytes_copied_mean"], d["bytes_copied_mean"]),
                "pause_shorter": ratio(f["pause_median_s"], d["pause_median_s"]),
                "throughput_full": f["throughput_ratio"],
                "throughput_delta": d["throughput_ratio"],
                "checkpoint_cpu_ms_per_step_full": f["checkpoint_cpu_ms_per_step"],
                "checkpoint_cpu_ms_per_step_delta": d["checkpoint_cpu_ms_per_step"],
            }
        )
    out["chain_restores"] = chain_restores(delta)
    out["background_shorter"] = ratio(
        full["train"]["alone"]["background_s"], delta["train"]["alone"]["background_s"]
    )
    # one full snapshot as a node holds it: its own step and the replica of its peer's, after an interval of
    # full copies with keep_memory=1 (the files' bytes: the state plus DCP's metadata)
    out["full_snapshot_bytes"] = full["train"]["intervals"][-1]["node_memory_end_bytes"]
    out["memory_peak_over_full_snapshot"] = ratio(
        delta["train"]["node_memory_peak_bytes"], out["full_snapshot_bytes"]
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="embedding weights + optimizer state, GiB")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.1, help="exponent of the ids' power law")
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--modes", default="full,delta", help="comma-separated: full, delta")
    ap.add_argument("--intervals", default="1:20,10:50,100:100", help="interval:steps, comma-separated")
    ap.add_argument(
        "--delta-every-step-steps",
        type=int,
        default=200,
        help="steps of the differential mode's checkpoint-every-step run (its throughput is the target; "
        "the full mode's every-step run, a pause of seconds per step, keeps --intervals' count)",
    )
    ap.add_argument(
        "--every-step-blocks",
        type=int,
        default=4,
        help="the differential every-step run alternates this many blocks with and without saves",
    )
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per mode")
    ap.add_argument("--name", default="delta", help="results file benchmarks/results/<name>.json")
    args = ap.parse_args()
    # a SIGTERM unwinds like an error: the workers, the servers and node memory are cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"full", "delta"}:
        raise SystemExit(f"--modes {args.modes!r}: a comma-separated list of 'full' and 'delta'")
    state = args.gib * 2**30
    need = PEAK_FACTOR * state + (1 << 30)
    if need > available_bytes():
        fits = (available_bytes() - (1 << 30)) / PEAK_FACTOR / 2**30
        raise SystemExit(
            f"--gib {args.gib:g} needs about {need / 2**30:.1f} GiB of memory at its peak and "
            f"{available_bytes() / 2**30:.1f} GiB are available: use --gib {max(fits, 0):.1f} or less"
        )
    rows = int(state / (args.tables * (args.dim * 4 + 4)))  # fp32 rows + one Adagrad value per row
    intervals = [tuple(int(x) for x in item.split(":")) for item in args.intervals.split(",")]
    work = Path(tempfile.mkdtemp(prefix="erm-delta-bench-"))
    print(
        f"delta benchmark: {args.tables} tables x {rows} rows x {args.dim} dim (~{args.gib:g} GiB with "
        f"row-wise Adagrad), zipf {args.zipf}, global batch {args.global_batch}; "
        f"load avg {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    report: dict[str, Any] = {
        "load_avg_at_run_start": os.getloadavg(),
        "config": {
            "gib": args.gib,
            "tables": args.tables,
            "dim": args.dim,
            "rows": rows,
            "zipf": args.zipf,
            "global_batch": args.global_batch,
            "intervals": intervals,
            "delta_every_step_steps": args.delta_every_step_steps,
            "every_step_blocks": args.every_step_blocks,
        },
        "modes": {},
    }
    try:
        for mode in modes:
            shm = Path(tempfile.mkdtemp(prefix="erm-delta-bench-", dir="/dev/shm"))
            spec = {
                **report["config"],
                "intervals": [
                    (i, args.delta_every_step_steps if mode == "delta" and i == 1 else n)
                    for i, n in intervals
                ],
                "mode": mode,
                "workdir": str(work),
                "shm": str(shm),
                "warmup_steps": 3,
                "baseline_steps": 40,
                "alone_gap_steps": 5,
                "every_step_blocks": args.every_step_blocks if mode == "delta" else 1,
                "phases": [{"kind": "train", "world": 2}, {"kind": "restore", "world": 3}],
            }
            try:
                with node_servers(shm, ["n0", "n1", "n2"]) as servers:
                    spec["phases"][0]["peers"] = peer_lists(servers, ["n0", "n1"])
                    spec["phases"][1]["peers"] = peer_lists(servers, ["n0", "n1", "n2"])
                    spec["server_pids"] = {n: s.proc.pid for n, s in servers.items()}
                    per_rank = launch(spec, 3, args.timeout)
                    store_peaks = {n: store_peak(servers[n]) for n in ("n0", "n1")}
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            train, restore = per_rank[0][0], per_rank[0][1]
            restore["exact"] = exact(mode, train, restore)
            train["store_peak_bytes"] = store_peaks  # the train phase's nodes, as their servers saw them
            report["modes"][mode] = {"train": train, "restore": restore}
            print_mode(mode, train, restore)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if {"full", "delta"} <= set(report["modes"]):
        report["ratios"] = compare(report["modes"]["full"], report["modes"]["delta"])
        print(json.dumps(report["ratios"], indent=1))
    print("wrote", write_result(args.name, report))


def print_mode(mode: str, train: dict[str, Any], restore: dict[str, Any]) -> None:
    gib = 2**30
    base = train["no_checkpoint"]["steps_per_s"]
    print(f"== {mode}: state {train['state_bytes'] / gib:.2f} GiB, no checkpoint {base:.2f} steps/s")
    for r in train["intervals"]:
        print(
            f"  every {r['interval']:>3}: touched {100 * r['touched']['mean']:.2f}%"
            f"  pause {fmt(r['pause_median_s'])}"
            f"  copied {r['bytes_copied_mean'] / gib:.3f} GiB"
            f"  replicated {r.get('bytes_replicated_mean', 0) / gib:.3f} GiB"
            f"  written {r.get('bytes_written_mean', 0) / gib:.3f} GiB"
            f"  throughput x{r['throughput_ratio']:.2f}"
            f"  checkpoint CPU {r['checkpoint_cpu_ms_per_step']:.1f} ms/step (servers"
            f" {r['cpu_ms_per_step']['servers']:.1f}; ranks' saves by part: "
            + ", ".join(f"{k} {v:.1f}" for k, v in r["checkpoint_cpu_ms_per_step_by_part"].items())
            + ")"
            f"  node memory {r['node_memory_end_bytes'] / gib:.2f} GiB (peak so far"
            f" {r['node_memory_peak_bytes'] / gib:.2f})  saves {r['kind_counts']}"
        )
    a = train["alone"]
    print(f"  one save alone ({a['kind']}): pause {fmt(a['pause_s'])}, background {fmt(a['background_s'])}")
    print(
        f"  node memory at its peak: {train['node_memory_peak_bytes'] / gib:.2f} GiB (checkpointer),"
        f" {max((v or 0 for v in train.get('store_peak_bytes', {}).values()), default=0) / gib:.2f} GiB"
        " (checkpoint servers)"
    )
    if mode == "full":
        print(
            f"  restore: same world {fmt(train['restore_same_world_s'])},"
            f" 2->3 {fmt(restore['restore_s'])} (exact: {restore['exact']})"
        )
    for label, c in train.get("chains", {}).items():
        if "restore_chain" not in c:
            print(
                f"  chain {label}: folds before {c['folds_before']} deltas"
                f" (at {c['before_fold']['deltas']}, node bytes over base"
                f" {c['before_fold']['node_bytes_over_base_max']:.2f})"
            )
            continue
        w3 = restore["chains"][label]
        print(
            f"  chain {label}: {c['deltas']} deltas, {c['bytes_over_base']:.2f}x the base's bytes;"
            f" restore same world {fmt(c['restore_chain']['s'])} vs full {fmt(c['restore_full']['s'])}"
            f" (x{c['chain_over_full']:.2f}), 2->3 {fmt(w3['chain']['restore_s'])}"
            f" vs full {fmt(w3['full']['restore_s'])}"
            f" (x{w3['chain']['restore_s'] / w3['full']['restore_s']:.2f}); same world by part: "
            + ", ".join(f"{k} {fmt(v)}" for k, v in c["restore_chain"]["parts_s"].items())
        )
    print(
        f"  every restore exact: {restore['exact']}; max RSS {train['max_rss_gib']:.2f} GiB per rank",
        flush=True,
    )


if __name__ == "__main__":
    main()
