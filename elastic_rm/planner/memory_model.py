"""Memory per node: sharded tables + optimizer state + activations + replicated dense + overhead; trend.

Row-wise sharded tables split evenly over w nodes; the dense part (and its optimizer state) is replicated;
activations scale with the per-node batch B/w. Embedding tables grow as new ids arrive, so the planner
also fits a linear trend to the observed bytes and asks when it crosses the OOM threshold (reference §4.4:
DLRover fits the per-step memory growth rate and migrates before the PS runs out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .job import JobSpec

ACT_BYTES_PER_SAMPLE_PER_DIM = 16  # forward+backward activations per sample per embedding dim, assumed


@dataclass(frozen=True)
class MemoryEstimate:
    tables: float
    optimizer: float
    dense: float
    activations: float
    overhead: float

    @property
    def total(self) -> float:
        return self.tables + self.optimizer + self.dense + self.activations + self.overhead


def estimate_node_memory(job: JobSpec, world: int, overhead_bytes: float) -> MemoryEstimate:
    """A priori bytes per node from the job's shapes (no observation)."""
    w = max(world, 1)
    tables = job.table_bytes / w
    dense = job.dense_bytes * (1 + job.optimizer_state_factor)
    dims = sum(t.dim for t in job.tables)
    act = job.global_batch / w * dims * ACT_BYTES_PER_SAMPLE_PER_DIM
    return MemoryEstimate(tables, tables * job.optimizer_state_factor, dense, act, overhead_bytes)


def rescale_observed(used_bytes: float, est_from: MemoryEstimate, est_to: MemoryEstimate) -> float:
    """Observed bytes at one world size carried to another: the sharded part scales, the rest stays."""
    sharded_from = est_from.tables + est_from.optimizer + est_from.activations
    sharded_to = est_to.tables + est_to.optimizer + est_to.activations
    fixed = max(used_bytes - sharded_from, est_from.dense + 0.0)
    if sharded_from <= 0:
        return used_bytes
    ratio = (used_bytes - fixed) / sharded_from if used_bytes > fixed else 1.0
    return fixed + sharded_to * max(ratio, 0.0)


@dataclass(frozen=True)
class Trend:
    """Least-squares line through (t, bytes): level at the last sample and slope (bytes/s)."""

    level: float
    slope: float
    n: int
    span_s: float = 0.0  # time between the first and the last point


def fit_trend(points: list[tuple[float, float]]) -> Trend | None:
    if len(points) < 3:
        return None
    ts = [p[0] for p in points]
    ys = [p[1] for p in points]
    tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - tm) ** 2 for t in ts)
    if var <= 0:
        return None
    slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys, strict=True)) / var
    level = ym + slope * (ts[-1] - tm)
    return Trend(level=max(level, ys[-1]), slope=slope, n=len(points), span_s=ts[-1] - ts[0])


def time_to_limit(trend: Trend, limit_bytes: float) -> float:
    """Seconds until the trend reaches ``limit_bytes`` (inf when flat or falling; 0 when already there)."""
    if trend.level >= limit_bytes:
        return 0.0
    if trend.slope <= 0:
        return math.inf
    return (limit_bytes - trend.level) / trend.slope
