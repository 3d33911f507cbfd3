"""The figures of `erm demo` and of the soak, as a results file in the run's own work directory.

The docs quote the demo's downtimes and the soak's figures. The run writes them where it writes everything
else (library code never writes into a checkout); the benchmark harness (``python -m benchmarks.demo``,
``python -m benchmarks.soak``) copies the file into benchmarks/results/, where benchmarks/figures.py checks
each quoted figure against it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def spread(values: list[float]) -> dict[str, Any]:
    """n, median, min, max of a list of seconds (None for an empty list)."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def demo_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What README quotes of an `erm demo` run, from its summary (elastic_rm.demo.summary.summarize plus
    checks)."""
    checks = summary.get("checks", [])
    return {
        "wall_s": summary["wall_s"],
        "downtime": [
            {"change": f"{d['from']}->{d['to']}", "seconds": d["seconds"]} for d in summary["downtime"]
        ],
        "throughput_samples_per_s": {str(w): rate for w, rate in summary["throughput"].items()},
        "rounds": len(summary.get("rounds", [])),
        "checks": len(checks),
        "checks_passed": sum(1 for c in checks if c["ok"]),
    }


def soak_figures(record: dict[str, Any]) -> dict[str, Any]:
    """What docs/guarantees.md quotes of a soak run, from the figures tests/chaos/test_soak.py records."""
    faults = record["faults"]
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    state, reference = record["state"], record["reference_state"]
    return {
        "seed": record["seed"],
        "minutes": record["minutes"],
        "faults_survived": len(faults),
        "faults_by_kind": kinds,
        "rounds": record["rounds"],
        "final_step": record["final_step"],
        "stretches": len(record["schedule"]),
        "back_at_world_3_s": spread([f["back_at_world_3_s_after_fault_end"] for f in faults]),
        "downtime_s": spread(list(record["downtime_s"])),
        "restarts_checked": record["restarts_checked"],
        "ledger_checks": record["ledger_checks"],
        "state": state,
        "reference_state": reference,
        # the soak's own criterion: `checksum`, the exact digest of all three states (every value keyed by
        # its tensor and global position; soak.json files from before it hold the sums at 11 digits)
        "state_equals_replay": state["checksum"] == reference["checksum"],
    }


def write_results_file(name: str, figures: dict[str, Any], directory: Path) -> Path:
    """<directory>/<name>.json: the figures with the machine's size and load and the time."""
    body = {
        "v": 1,
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        **figures,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path


def write_demo_results(summary: dict[str, Any], directory: Path) -> Path:
    """`erm demo`'s figures to <directory>/demo.json (README quotes them once the harness copied them)."""
    return write_results_file("demo", demo_figures(summary), directory)


def write_soak_results(record: dict[str, Any], directory: Path) -> Path:
    """The soak's figures to <directory>/soak.json (docs/guarantees.md quotes them once copied)."""
    return write_results_file("soak", soak_figures(record), directory)
