"""Where a kept worker's and an agent's memory goes, round by round, from the probe's files.

``python -m benchmarks.recovery.memory --probe DIR`` leaves one JSON file per process and round in DIR
(``benchmarks/recovery/memory_probe``); this reads them and writes
``benchmarks/results/<--name>.json``: for each kept worker, agent and waiting spare (the processes probed
from the first round on), per round: RSS (anonymous and file), glibc's heap in use (``uordblks + hblkhd``),
of which mapped blocks, its free bytes held in arenas, each arena's size, the Python heap allocated
since round 0 and still alive (``tracemalloc``) with the part ``linecache`` holds, the live tensors'
bytes, the objects the collector tracks, the modules imported since the previous round and the threads.
``--commit`` names the code the probe ran (the figures are of that code).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

from benchmarks.common import write_result

MIB = 2**20


def load(directory: str) -> dict[int, dict[int, dict]]:
    by_pid: dict[int, dict[int, dict]] = defaultdict(dict)
    for path in glob.glob(os.path.join(directory, "*-*.json")):
        with open(path) as fh:
            d = json.load(fh)
        by_pid[d["pid"]][int(d["tag"])] = d
    return by_pid


def kib(text: str | None) -> float:
    return int(str(text).split()[0]) / 1024 if text else 0.0


def row(d: dict, prev: dict | None) -> dict:
    p, m, py = d["proc"], d["malloc"], d["py"]
    lines = py.get("tm_lineno", {})
    new = sorted(set(py.get("modules", [])) - set(prev["py"].get("modules", []))) if prev else []
    return {
        "round": int(d["tag"]),
        "rss_mib": round(kib(p["VmRSS"]), 1),
        "anon_mib": round(kib(p["RssAnon"]), 1),
        "file_mib": round(kib(p["RssFile"]), 1),
        "heap_in_use_mib": round((m["uordblks"] + m["hblkhd"]) / MIB, 1),
        "heap_mapped_mib": round(m["hblkhd"] / MIB, 1),
        "heap_free_held_mib": round(m["fordblks"] / MIB, 1),
        "arenas": len(m.get("arenas", [])),
        "arena_mib": [round((a["system"] or 0) / MIB, 1) for a in m.get("arenas", [])],
        "python_since_round0_mib": round(py.get("traced", [0])[0] / MIB, 2),
        "linecache_mib": round(sum(v[0] for k, v in lines.items() if "linecache.py" in k) / MIB, 2),
        "tensor_mib": round(py.get("tensor_bytes", 0) / MIB, 1),
        "objects": py.get("n_objects"),
        "modules": len(py.get("modules", [])),
        "new_modules": new,
        "threads": int(p["Threads"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="the probe's directory (memory --probe DIR)")
    p.add_argument("--commit", required=True, help="the commit whose code the probe ran")
    p.add_argument("--name", default="recovery-memory-breakdown", help="results file name")
    args = p.parse_args()
    processes = {}
    for pid, rounds in sorted(load(args.directory).items()):
        if 0 not in rounds or len(rounds) < 2:
            continue  # a joiner's worker or a spare used later: not kept from the first round
        argv = rounds[0]["argv"]
        role = "agent" if "ermrun" in argv else "spare" if "spare.py" in argv else "worker"
        if "guard.py" in argv:
            continue
        series, prev = [], None
        for r in sorted(rounds):
            series.append(row(rounds[r], prev))
            prev = rounds[r]
        processes[f"{role}-{pid}"] = {"role": role, "rounds": series}
    path = write_result(
        args.name, {"commit": args.commit, "directory": args.directory, "processes": processes}
    )
    for name, proc in processes.items():
        first, last = proc["rounds"][0], proc["rounds"][-1]
        print(
            f"{name}: RSS {first['rss_mib']} -> {last['rss_mib']} MiB, heap in use "
            f"{first['heap_in_use_mib']} -> {last['heap_in_use_mib']}, free held "
            f"{first['heap_free_held_mib']} -> {last['heap_free_held_mib']}"
        )
    print("wrote", path)


if __name__ == "__main__":
    main()
