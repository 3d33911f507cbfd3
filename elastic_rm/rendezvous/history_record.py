"""What a finished run leaves for the next one: a history record (schema: docs/planner.md), built from the
last round and the members' last published metrics, kept under ``<prefix>/history/<signature>/<run>``."""

from __future__ import annotations

import time

from ..planner.interface import NodeMetrics
from ..planner.job import parse_job
from ..wire.records import RoundRecord


def build_history_record(
    job: dict,
    run_id: str,
    status: str,
    last_round: RoundRecord,
    metrics: dict[str, NodeMetrics],
    cpu_counts: dict[str, int],
    duration_s: float,
    gpu_counts: dict[str, int] | None = None,
    coef: list[float] | None = None,
) -> dict:
    """Stage 1 of the planner reads these: the world size the run ended at, its throughput, the per-node
    peaks (cores and bytes) that sized it, the members' capacity (GPUs, or cores/16, as the planner counts
    it) and the model coefficients the leader fitted on this run (its latest outcome record)."""
    gpu_counts = gpu_counts or {}
    caps = [
        float(gpu_counts[m]) if gpu_counts.get(m) else max(cpu_counts.get(m, 0), 1) / 16.0
        for m in last_round.members
    ]
    members = [m for m in last_round.members if m in metrics]
    samples = sum(metrics[m].steps.samples_per_s for m in members if metrics[m].steps is not None)
    cores = [metrics[m].cpu_util * cpu_counts.get(m, 0) for m in members]
    return {
        "v": 1,
        "signature": parse_job(job).signature(),
        "run_id": run_id,
        "finished_at": time.time(),
        "status": status,
        "world_size": len(last_round.members),
        "capacity": sum(caps) / len(caps) if caps else 1.0,
        "throughput": float(samples),
        "cpu_per_node_used": float(max(cores, default=0.0)),
        "mem_per_node_peak_bytes": float(max((metrics[m].mem_used_bytes for m in members), default=0)),
        "mem_growth_bytes_per_s": 0.0,
        "coef": [float(c) for c in coef] if coef and len(coef) == 4 and min(coef) >= 0 else [],
        "duration_s": max(0.0, float(duration_s)),
    }
