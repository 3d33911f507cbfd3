"""Stage 1, warm start: history records of finished runs -> a starting world size and per-node budgets.

A record (schema ``"v": 1`` in docs/planner.md) is what one finished run used and achieved; the rendezvous
keeps them under ``<prefix>/history/<signature>/<run>``. Aggregation is robust (DLRover's MajorCluster: the
mean of the median-centred half), memory takes the worst run, failures by OOM raise the memory floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import PlannerConfig
from .job import LARGEST, JobSpec, finite
from .memory_model import estimate_node_memory, rescale_observed

HISTORY_STATUSES = ("completed", "failed", "oom")


RECORD_FIELDS = frozenset(
    {"v", "signature", "run_id", "finished_at", "status", "world_size", "capacity", "throughput"}
    | {"cpu_per_node_used", "mem_per_node_peak_bytes", "mem_growth_bytes_per_s", "coef", "duration_s"}
)  # what to_dict writes; parse_record takes more (a later writer's), `erm plan` does not (a typo)


class HistoryError(ValueError):
    """A history record is malformed; the message names the field."""


@dataclass(frozen=True)
class HistoryRecord:
    signature: str
    run_id: str
    finished_at: float
    status: str
    world_size: int
    capacity: float
    throughput: float
    cpu_per_node_used: float
    mem_per_node_peak_bytes: float
    mem_growth_bytes_per_s: float = 0.0
    coef: tuple[float, ...] = ()
    duration_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "v": 1,
            "signature": self.signature,
            "run_id": self.run_id,
            "finished_at": self.finished_at,
            "status": self.status,
            "world_size": self.world_size,
            "capacity": self.capacity,
            "throughput": self.throughput,
            "cpu_per_node_used": self.cpu_per_node_used,
            "mem_per_node_peak_bytes": self.mem_per_node_peak_bytes,
            "mem_growth_bytes_per_s": self.mem_growth_bytes_per_s,
            "coef": list(self.coef),
            "duration_s": self.duration_s,
        }


def parse_record(d: object, where: str = "history record") -> HistoryRecord:
    if not isinstance(d, dict):
        raise HistoryError(f"{where}: expected an object")
    if d.get("v") != 1:
        raise HistoryError(f"{where}: field 'v' must be 1, got {d.get('v')!r}")

    def num(key: str, minimum: float = 0.0, default: float | None = None) -> float:
        v = d.get(key, default)
        if v is None:
            raise HistoryError(f"{where}: missing field '{key}'")
        if isinstance(v, bool) or not isinstance(v, int | float) or not finite(v) or v < minimum:
            raise HistoryError(f"{where}: field '{key}' must be a finite number >= {minimum}, got {v!r}")
        if v > LARGEST:  # a peak of 1e308 bytes, doubled for an OOM, was a budget of inf GiB
            raise HistoryError(f"{where}: field '{key}' must be <= {LARGEST:g}, got {v!r}")
        return float(v)

    for key in ("signature", "run_id", "status"):
        if not isinstance(d.get(key), str):
            raise HistoryError(f"{where}: field '{key}' must be a string")
    if d["status"] not in HISTORY_STATUSES:
        raise HistoryError(f"{where}: field 'status' must be one of {HISTORY_STATUSES}, got {d['status']!r}")
    coef = d.get("coef", [])
    if not isinstance(coef, list) or (coef and len(coef) != 4):
        raise HistoryError(f"{where}: field 'coef' must be a list of 4 numbers or empty")
    # finite too: json.loads reads NaN and Infinity, and NaN < 0 is False (a NaN prior reached the model)
    if any(isinstance(c, bool) or not isinstance(c, int | float) or not finite(c) or c < 0 for c in coef):
        raise HistoryError(f"{where}: field 'coef' must hold finite non-negative numbers, got {coef!r:.80}")
    world = num("world_size", 1)
    if not world.is_integer():
        raise HistoryError(f"{where}: field 'world_size' must be an integer")
    return HistoryRecord(
        signature=d["signature"],
        run_id=d["run_id"],
        finished_at=num("finished_at"),
        status=d["status"],
        world_size=int(world),
        capacity=num("capacity", 0.0, 1.0),
        throughput=num("throughput"),
        cpu_per_node_used=num("cpu_per_node_used"),
        mem_per_node_peak_bytes=num("mem_per_node_peak_bytes"),
        mem_growth_bytes_per_s=num("mem_growth_bytes_per_s", -1e18, 0.0),
        coef=tuple(float(c) for c in coef),
        duration_s=num("duration_s", 0.0, 0.0),
    )


def major_cluster_mean(values: list[float]) -> float:
    """Mean of the floor(n/2)+1 values grown around the median (DLRover's ComputeMajorCluster)."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("no values")
    need = n // 2 + 1
    lo = hi = (n - 1) // 2
    while hi - lo + 1 < need:
        mid = (v[lo] + v[hi]) / 2
        left = mid - v[lo - 1] if lo > 0 else math.inf
        right = v[hi + 1] - mid if hi + 1 < n else math.inf
        if left <= right:
            lo -= 1
        else:
            hi += 1
    return sum(v[lo : hi + 1]) / (hi - lo + 1)


@dataclass(frozen=True)
class StartPlan:
    """Where to start: world size and per-node budgets, with why and how sure."""

    world: int
    cpu_per_node: float  # cores; 0 = unknown (keep the request)
    mem_per_node_bytes: float
    coef: tuple[float, ...]  # model prior from history; () = physical default
    reason: str
    confidence: float
    from_history: int  # records used
    warm: bool = False  # the size came from finished runs (else the request, or MAX)


def warm_start(
    job: JobSpec,
    records: list[HistoryRecord],
    min_nodes: int,
    max_nodes: int,
    cfg: PlannerConfig,
    waiting: int = 0,
) -> StartPlan:
    """Stage 1. With history: robust world/CPU/coefficients, worst-case memory + margin; else cold start.
    While ``waiting`` nodes are wanted by queued jobs, a size past the request keeps only the nodes that
    bring ``queued_node_gain`` of an average node on the history's model (none without one)."""
    sig = job.signature()
    mine = sorted((r for r in records if r.signature == sig), key=lambda r: r.finished_at)
    mine = mine[-cfg.history_max :] if cfg.history_max > 0 else []  # [-0:] was every record, not none
    lo, hi = max(min_nodes, 1), max(max_nodes, min_nodes, 1)
    good = [r for r in mine if r.status == "completed"]
    if not good:
        return _cold_start(job, mine, lo, hi, cfg)
    world = min(max(round(major_cluster_mean([r.world_size for r in good])), lo), hi)
    coefs = [r.coef for r in good if len(r.coef) == 4]
    coef = tuple(major_cluster_mean([c[i] for c in coefs]) for i in range(4)) if coefs else ()
    req = job.request.nodes if job.request else 0
    if coef and lo <= world < req <= hi:  # past runs ended smaller (a full cluster, failures): the user's
        # rule on the model of those runs decides whether the request's nodes are needed
        from .perf_model import Fit
        from .scaling import user_floor

        cap = major_cluster_mean([r.capacity for r in good])
        model = Fit(coef, float("nan"), 0.0, 0, ())
        world = max(world, user_floor(model, job, cap, req, lo, cfg.user_loss_max, [])[0])
    why = ""
    queued = waiting > 0 and cfg.queued_node_gain > cfg.lent_node_gain
    if queued and lo <= req < world:  # past runs grew past the request: capacity others now wait for
        from .perf_model import Fit, best_world
        from .scaling import shape_of

        bar = max(cfg.queued_node_gain, cfg.lent_node_gain)
        model = Fit(coef, float("nan"), 0.0, 0, ())
        cap = major_cluster_mean([r.capacity for r in good])
        world = best_world(model, shape_of(job), cap, req, world, bar)[0] if coef else req
        why = f"; {waiting} node(s) wanted by queued jobs: at most the request"
        why += f" + nodes bringing >= {bar:.0%} of an average node" if coef else ""
    est_to = estimate_node_memory(job, world, cfg.cold_overhead_bytes)
    mem = 0.0
    for r in mine:  # failed and OOM runs count too: their peak is a floor of the need
        est_from = estimate_node_memory(job, r.world_size, cfg.cold_overhead_bytes)
        peak = rescale_observed(r.mem_per_node_peak_bytes, est_from, est_to)
        if r.status == "oom":
            peak *= cfg.oom_restart_factor
        mem = max(mem, peak)
    growth = max(major_cluster_mean([r.mem_growth_bytes_per_s * r.world_size for r in good]) / world, 0.0)
    mem_budget = mem * (1 + cfg.mem_margin) + growth * cfg.mem_growth_horizon_s
    cpu = major_cluster_mean([r.cpu_per_node_used for r in good])
    cpu_budget = cpu * (1 + cfg.cpu_margin_frac) + cfg.cpu_margin_cores if cpu > 0 else 0.0
    tps = [r.throughput / max(r.world_size, 1) for r in good]
    spread = (max(tps) - min(tps)) / max(major_cluster_mean(tps), 1e-9) if len(tps) > 1 else 0.5
    conf = min(0.95, (1 - 1 / (1 + len(good))) * max(0.2, 1 - spread))
    return StartPlan(
        world=world,
        cpu_per_node=cpu_budget,
        mem_per_node_bytes=mem_budget,
        coef=coef,
        reason=f"warm start from {len(good)} finished run(s) of {sig}: {world} node(s){why}",
        confidence=conf,
        from_history=len(mine),
        warm=True,
    )


def _cold_start(job: JobSpec, failed: list[HistoryRecord], lo: int, hi: int, cfg: PlannerConfig) -> StartPlan:
    """No finished run: the configured or requested node count (else MAX, as torch takes every node up to
    MAX), memory from the model x (1 + cold margin)."""
    req = job.request
    want = cfg.cold_start_nodes or (req.nodes if req else hi)
    world = min(max(want, lo), hi)
    est = estimate_node_memory(job, world, cfg.cold_overhead_bytes).total * (1 + cfg.cold_mem_margin)
    if req and req.mem_per_node_bytes > est and world == req.nodes:  # never less than the user asked
        est = float(req.mem_per_node_bytes)  # before anything was observed (resized once measured)
    for r in failed:
        if r.status == "oom":
            est = max(est, r.mem_per_node_peak_bytes * cfg.oom_restart_factor)
    return StartPlan(
        world=world,
        cpu_per_node=0.0,
        mem_per_node_bytes=est,
        coef=(),
        reason=(
            f"cold start: no finished run of {job.signature()}; {world} node(s), "
            f"memory from the model +{cfg.cold_mem_margin:.0%}"
        ),
        confidence=0.3,
        from_history=len(failed),
    )
