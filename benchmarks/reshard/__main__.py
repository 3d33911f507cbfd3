"""Benchmark: flash checkpoint vs. two baselines, a synchronous DCP disk save and torch's `dcp.async_save`
(staging in memory, writing to disk in a thread), and the memcpy floor, for ~1 GiB of embeddings + Adagrad
state moved between world 2 and world 3 on this machine.

    .venv/bin/python -m benchmarks.reshard [--gib 1.0] [--disk-dir DIR]

Prints ratios against the targets (step pause >= 10x shorter than a synchronous disk save; restore
within 3x the memcpy floor + 1 s) and writes benchmarks/results/reshard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, write_result
from benchmarks.ranks import run_ranks
from elastic_rm.checkpoint.local_servers import node_servers, peer_lists


def launch(spec: dict[str, Any], nprocs: int, timeout: float) -> list[list[dict[str, Any]]]:
    work = Path(spec["workdir"])
    (work / "spec.json").write_text(json.dumps(spec))
    run_ranks(
        "benchmarks.reshard.worker",
        work / "spec.json",
        nprocs,
        timeout,
        lambda r: work / f"log-{r}.txt",
        "benchmark",
    )
    return [json.loads((work / f"result-{r}.json").read_text()) for r in range(nprocs)]


def new_spec(gib: float, tables: int, dim: int, prefix: str) -> dict[str, Any]:
    """A benchmark spec without phases: table shape for `gib` GiB of fp32 weights + Adagrad state (as big
    as the weights), a work directory and a node-memory directory in /dev/shm."""
    return {
        "workdir": tempfile.mkdtemp(prefix=prefix),
        "shm": tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"),
        "tables": tables,
        "dim": dim,
        "rows": int(gib * 2**30 / 2 / (tables * dim * 4)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0, help="embeddings + optimizer state, GiB (default 1)")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--disk-dir", default=None, help="local disk directory (default: a temp dir on /tmp)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--name", default="reshard", help="results file benchmarks/results/<name>.json")
    args = ap.parse_args()
    spec = new_spec(args.gib, args.tables, args.dim, "erm-reshard-bench-")
    work, shm, rows = Path(spec["workdir"]), Path(spec["shm"]), spec["rows"]
    disk = Path(args.disk_dir or work / "disk")
    spec.update(
        {
            "phases": [
                {"world": 2, "save": True, "disk_to": str(disk / "w2")},
                {
                    "world": 3,
                    "restore": True,
                    "disk_from": str(disk / "w2"),
                    "save": True,
                    "disk_to": str(disk / "w3"),
                },
                {"world": 2, "restore": True, "disk_from": str(disk / "w3")},
            ],
        }
    )
    print(
        f"reshard benchmark: {args.tables} tables x {rows} rows x {args.dim} dim, fp32, fused Adagrad "
        f"(~{args.gib:g} GiB weights + state); load avg {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    try:
        with node_servers(shm, ["n0", "n1", "n2"]) as servers:  # what each node's agent runs under ermrun
            spec["servers"] = {n: s.peer() for n, s in servers.items()}
            for ph in spec["phases"]:
                ph["peers"] = peer_lists(servers, [f"n{r}" for r in range(ph["world"])])
            per_rank = launch(spec, 3, args.timeout)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    phases = {r["phase"]: r for r in per_rank[0]}  # every value is already the max/sum over ranks
    report: dict[str, Any] = {"config": {k: spec[k] for k in ("tables", "dim", "rows")}, "phases": phases}
    rows_out = []
    for src, dst in ((0, 1), (1, 2)):
        s, d = phases[src], phases[dst]
        pause = s["flash_warm_pause_s"]
        floor = d["memcpy_s"]
        budget = 3 * floor + 1.0
        row = {
            "transition": f"{s['world']}->{d['world']}",
            "state_gib": s["state_bytes"] / 2**30,
            "flash_pause_s": pause,
            "flash_pause_cold_s": s["flash_cold_pause_s"],
            "flash_prepare_s": s["flash_prepare_s"],
            "flash_background_s": s["flash_warm_background_s"],
            "disk_save_s": s["disk_save_s"],
            "pause_ratio": s["disk_save_s"] / pause,
            "async_save_pause_s": s["async_save_pause_s"],
            "async_save_total_s": s["async_save_total_s"],
            "async_pause_ratio": s["async_save_pause_s"] / pause,
            "flash_restore_s": d["flash_restore_s"],
            "flash_restore_verify_s": d["flash_verify_s"],
            "flash_restore_dcp_s": d["flash_dcp_load_s"],
            "flash_restore_noverify_s": d["flash_restore_noverify_s"],
            "disk_restore_s": d["disk_restore_s"],
            "memcpy_floor_s": floor,
            "restore_over_memcpy": d["flash_restore_s"] / floor,
            "restore_budget_s": budget,
            "pause_target_met": s["disk_save_s"] / pause >= 10,
            "restore_target_met": d["flash_restore_s"] <= budget,
            "mismatches": d["flash_restore_bad"] + d["disk_restore_bad"] + d["http_all_restore_bad"],
            # every file from the nodes' memory directories vs every file over HTTP (loopback) into memory
            "restore_all_from_memory_s": d["mem_all_restore_s"],
            "restore_all_over_http_s": d["http_all_restore_s"],
            "http_over_memory": d["http_all_restore_s"] / d["mem_all_restore_s"],
            "http_fetched_gib": d["http_all_fetched_bytes"] / 2**30,
            "files_needed_gib": d["files_needed_bytes"] / 2**30,
        }
        rows_out.append(row)
    report["results"] = rows_out
    hdr = (
        f"{'':6} {'pause':>8} {'cold':>8} {'bg write':>9} {'disk save':>10} {'ratio':>6} | "
        f"{'restore':>8} {'disk rst':>9} {'memcpy':>8} {'3x+1s':>8} {'ok':>6}"
    )
    print(hdr)
    for r in rows_out:
        ok = ("yes" if r["pause_target_met"] else "NO") + "/" + ("yes" if r["restore_target_met"] else "NO")
        print(
            f"{r['transition']:6} {fmt(r['flash_pause_s']):>8} {fmt(r['flash_pause_cold_s']):>8} "
            f"{fmt(r['flash_background_s']):>9} {fmt(r['disk_save_s']):>10} {r['pause_ratio']:>5.1f}x | "
            f"{fmt(r['flash_restore_s']):>8} {fmt(r['disk_restore_s']):>9} {fmt(r['memcpy_floor_s']):>8} "
            f"{fmt(r['restore_budget_s']):>8} "
            f"{ok:>6}"
        )
        print(
            f"  {r['transition']} dcp.async_save: step pause {fmt(r['async_save_pause_s'])} "
            f"({r['async_pause_ratio']:.1f}x the flash pause), on disk after {fmt(r['async_save_total_s'])}"
        )
        print(
            f"  {r['transition']} restore: {r['state_gib']:.2f} GiB, of which checksum block checks (xxh3) "
            f"{fmt(r['flash_restore_verify_s'])} (slowest rank); same restore with size checks only "
            f"{fmt(r['flash_restore_noverify_s'])}; restore/memcpy {r['restore_over_memcpy']:.1f}x"
        )
        print(
            f"  {r['transition']} network path: every file over HTTP {fmt(r['restore_all_over_http_s'])} "
            f"({r['http_fetched_gib']:.2f} GiB fetched, all ranks) vs every file from node memory "
            f"{fmt(r['restore_all_from_memory_s'])}: {r['http_over_memory']:.1f}x"
        )
        if r["mismatches"]:
            print(f"  !! {r['transition']}: {r['mismatches']:.0f} elements differ after restore")
    print(
        "pause = in-step flash save after FlashCheckpointer.prepare() (snapshot into reused memory; the DCP"
        " write to /dev/shm runs in the background), max over ranks; cold = first save without prepare();"
        " ok = pause >= 10x shorter than the disk save / restore <= 3x memcpy + 1 s"
    )
    path = write_result(args.name, report)
    print(f"wrote {path}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
