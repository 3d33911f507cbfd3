"""Stage 2: from the fitted model to a target world size and per-node budgets.

The target obeys, in order: MIN/MAX, the memory floor (the smallest world whose per-node memory fits under
the OOM threshold for the growth horizon), the marginal-gain rule with a hysteresis band (scale up to the
size where the next node brings < g of an average node; scale down only past the size for 0.75 g), and at
most ``max_step`` nodes per round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .config import PlannerConfig
from .job import JobSpec
from .memory_model import estimate_node_memory, rescale_observed
from .perf_model import Fit, Sample, Shape, best_world, fit


def shape_of(job: JobSpec) -> Shape:
    return Shape(job.global_batch, job.emb_bytes_per_sample, job.dense_bytes, job.bandwidth)


def fit_configs(job: JobSpec, samples: list[Sample], prior: tuple[float, ...]) -> Fit:
    import numpy as np

    return fit(shape_of(job), samples, np.asarray(prior) if prior else None)


def memory_floor(
    job: JobSpec,
    cfg: PlannerConfig,
    world: int,
    per_node_now: float,
    growth_per_node: float,
    node_mem: float,
    lo: int,
    hi: int,
) -> int:
    """Smallest world in [lo, hi] whose forecast per-node memory stays under the OOM threshold."""
    if node_mem <= 0 or per_node_now <= 0:
        return lo
    for w in range(lo, hi + 1):
        if memory_forecast(job, cfg, world, per_node_now, growth_per_node, w) <= cfg.oom_threshold * node_mem:
            return w
    return hi


def memory_forecast(
    job: JobSpec, cfg: PlannerConfig, world: int, per_node_now: float, growth_per_node: float, to_world: int
) -> float:
    """Per-node bytes at ``to_world`` nodes: what ``world`` nodes use now, carried over (the sharded part
    scales), plus the job's growth for the growth horizon spread over them."""
    est_now = estimate_node_memory(job, world, cfg.cold_overhead_bytes)
    est_to = estimate_node_memory(job, to_world, cfg.cold_overhead_bytes)
    total_growth = growth_per_node * world * cfg.mem_growth_horizon_s
    return rescale_observed(per_node_now, est_now, est_to) + total_growth / to_world


@dataclass(frozen=True)
class Target:
    world: int
    throughput: float
    current_throughput: float
    confidence: float
    why: str


def choose_world(
    f: Fit,
    job: JobSpec,
    capacity: float,
    current: int,
    lo: int,
    hi: int,
    cfg: PlannerConfig,
    cap: int | None = None,
    floor: int = 0,
    floor_why: str = "",
    request: int = 0,
    waiting: int = 0,
    queues: bool = False,
) -> Target:
    """Hysteresis around the marginal-gain rule, capped by what was measured (``cap``, see observed_cap),
    never below ``floor`` (the user's rule, see user_floor); never outside [lo, hi] nor more than
    max_step away. Beyond the user's ``request`` a node must bring ``lent_node_gain`` of an average node:
    those nodes are lent by a shared cluster. While ``waiting`` nodes are wanted by queued jobs the bar is
    ``queued_node_gain``, and lent nodes below it are given back (at most ``waiting`` of them); the bar
    stays while the cluster ``queues`` (its queue was seen recently), since later arrivals wait too. The
    queued bar also holds past the user's ``floor`` below the request: growth stops where nodes past it
    stop clearing the bar, and while demand waits those below it are given back (never below the floor)."""
    shape = shape_of(job)
    g = cfg.min_marginal_gain
    high = waiting > 0 or queues
    lent = max(cfg.lent_node_gain, cfg.queued_node_gain) if high else cfg.lent_node_gain
    up, _ = best_world(f, shape, capacity, lo, hi, g)
    if 0 < request < up and up > current and lent > g:  # beyond the request: lent capacity
        base = max(request, current, lo)
        up = best_world(f, shape, capacity, base, hi, lent)[0]
    keep, _ = best_world(f, shape, capacity, lo, hi, 0.75 * g)
    if current < lo:
        target, why = lo, f"memory floor: with fewer than {lo} nodes memory would cross the OOM threshold"
    elif current < up:
        bar = max(lent, g) if 0 < request < up else g
        target, why = up, f"the next node up to {up} brings >= {bar:.0%} of an average node"
    elif current > max(keep, lo):
        target, why = max(keep, lo), f"nodes beyond {max(keep, lo)} bring < {0.75 * g:.0%} of an average node"
    else:
        target, why = current, "at the marginal-gain optimum"
    if waiting > 0 and max(request, lo) < current and lent > g:  # give lent nodes back, at most `waiting`
        back = max(best_world(f, shape, capacity, max(request, lo), hi, lent)[0], current - waiting)
        if back < target:
            target = back
            why = (
                f"{waiting} node(s) wanted by queued jobs: nodes past the request of {request} bring "
                f"< {lent:.0%} of an average node"
            )
    if high and floor > 0 and lent > g:  # while the cluster queues, the bar applies past the user's floor too
        base = max(min(floor, hi), lo)
        queued = best_world(f, shape, capacity, base, hi, lent)[0]
        if current < target and queued < target:  # grow only by nodes that clear the queued bar
            target = max(current, queued)
            why = f"the cluster queues: nodes past {target} bring < {lent:.0%} of an average node"
        back = max(queued, current - waiting)
        if waiting > 0 and back < min(target, current):  # give nodes back down to it, at most `waiting`
            target = back
            why = (
                f"{waiting} node(s) wanted by queued jobs: nodes past the user's floor of {base} bring "
                f"< {lent:.0%} of an average node"
            )
    if cap is not None and cap >= lo and target > cap:
        target, why = cap, f"measured: nodes beyond {cap} brought < {g:.0%} of an average node"
    if target < min(floor, hi):
        target, why = min(floor, hi), floor_why
    target = min(max(target, current - cfg.max_step, lo), current + cfg.max_step, hi)
    return Target(
        world=target,
        throughput=f.throughput(shape, target, capacity),
        current_throughput=f.throughput(shape, current, capacity),
        confidence=f.confidence(target),
        why=why,
    )


def observed_cap(samples: list[tuple[int, float]], min_gain: float, min_per_size: int = 2) -> int | None:
    """The measured side of the marginal-gain rule (DLRover's speed-ratio check after a scaling step).

    From (world, step time) samples: the smallest measured size w1 such that a larger measured size w2
    brought less than ``min_gain`` x w1's average node per added node. The model proposes; this vetoes
    what the job has already shown not to pay. None when nothing was refuted.
    """
    by_world: dict[int, list[float]] = {}
    for w, s in samples:
        by_world.setdefault(w, []).append(s)
    tp = {w: 1.0 / statistics.median(v) for w, v in by_world.items() if len(v) >= min_per_size}
    sizes = sorted(tp)
    for i, w1 in enumerate(sizes):
        for w2 in sizes[i + 1 :]:
            if tp[w2] - tp[w1] < min_gain * (w2 - w1) * tp[w1] / w1:
                return w1
    return None


def user_floor(
    f: Fit,
    job: JobSpec,
    capacity: float,
    request: int,
    lo: int,
    loss_max: float,
    measured: list[tuple[int, float]],
) -> tuple[int, str]:
    """ "Never worse than the user": the smallest world below the requested node count whose throughput
    stays within ``loss_max`` of the request's, predicted by the model, and measured once both sizes ran.

    Measured sizes win over the model: a size measured below (1 - loss_max) of the measured request is
    refuted (the floor goes back up to the request), and one measured within it is accepted.
    """
    if request <= lo:
        return lo, ""
    shape = shape_of(job)
    by_world: dict[int, list[float]] = {}
    for w, s in measured:
        by_world.setdefault(w, []).append(s)
    tp_m = {w: 1.0 / statistics.median(v) for w, v in by_world.items()}
    ref = tp_m.get(request)
    floor = request
    for w in range(request - 1, lo - 1, -1):
        if ref is not None and w in tp_m:
            ok = tp_m[w] >= (1 - loss_max) * ref
        else:
            ok = f.throughput(shape, w, capacity) >= (1 - loss_max) * f.throughput(shape, request, capacity)
        if not ok:
            break
        floor = w
    why = f"the user's {request} node(s): fewer would lose > {loss_max:.0%} of the request's throughput"
    return floor, why


def budgets(
    cfg: PlannerConfig, peak_cpu: float, peak_mem: float, growth_per_node: float, alloc_cpu: float = 0.0
) -> tuple[float, float]:
    """Per-node CPU cores and memory bytes to ask for: observed peak + margins (+ growth for memory).

    A node using (nearly) all its cores may be starved: its need is unknown, so ask for 1.5x what it has.
    """
    if alloc_cpu > 0 and peak_cpu >= 0.95 * alloc_cpu:
        cpu = alloc_cpu * 1.5
    else:
        cpu = peak_cpu * (1 + cfg.cpu_margin_frac) + cfg.cpu_margin_cores if peak_cpu > 0 else 0.0
    mem = (
        peak_mem * (1 + cfg.mem_margin) + growth_per_node * cfg.mem_growth_horizon_s if peak_mem > 0 else 0.0
    )
    return cpu, mem
