"""Stage 3 detectors: stragglers (with hysteresis and hardware signals) and OOM from the memory trend.

Pure functions of the state windows. They update counters only when a fresh sample was recorded at
``now``, so asking twice with the same snapshot changes nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .config import PlannerConfig
from .memory_model import Trend, fit_trend, time_to_limit
from .state import NodeSample, PlannerState, reference_busy, slow_bar, step_times, warmed_up


def _is_slow(
    s: NodeSample, med_busy: float, steps: list[float], med_gpu: float, k: float, cfg: PlannerConfig
) -> bool:
    if s.throttled:
        return True
    if med_busy > 0 and s.busy_s > slow_bar(med_busy, steps, k, cfg.straggler_min_share):
        return True
    return med_gpu > 0 and 0 <= s.gpu_util < cfg.low_gpu_util * med_gpu


def update_stragglers(
    state: PlannerState, members: tuple[str, ...], now: float, cfg: PlannerConfig
) -> tuple[dict[str, int], frozenset[str]]:
    """Consecutive slow/fast counts per member; flag after ``enter`` slow, clear after ``exit`` fast."""
    latest = {m: state.nodes[m][-1] for m in members if m in state.nodes and state.nodes[m][-1].t == now}
    slow = {m: c for m, c in state.slow.items() if m in members}
    flagged = set(state.flagged)  # non-members keep their flag while alive (the caller prunes the dead)
    if not warmed_up(state, now, cfg.round_warmup_s):  # a new world's first steps are not its pace
        return slow, frozenset(flagged)
    if len(latest) < 2:
        return slow, frozenset(flagged)
    med_busy = reference_busy([s.busy_s for s in latest.values()], cfg.straggler_k)
    steps = step_times(latest.values())
    gpus = [s.gpu_util for s in latest.values() if s.gpu_util >= 0]
    med_gpu = statistics.median(gpus) if gpus else -1.0
    for m, s in latest.items():
        if m in flagged:
            fast = not _is_slow(s, med_busy, steps, med_gpu, cfg.straggler_clear_k, cfg)
            count = slow.get(m, 0) - 1 if fast else 0
            count = min(count, 0)
            if -count >= cfg.straggler_exit:
                flagged.discard(m)
                count = 0
        else:
            count = slow.get(m, 0) + 1 if _is_slow(s, med_busy, steps, med_gpu, cfg.straggler_k, cfg) else 0
            if count >= cfg.straggler_enter:
                flagged.add(m)
                count = 0
        slow[m] = count
    return slow, frozenset(flagged)


MAX_EXTRAPOLATION = 5.0


@dataclass(frozen=True)
class OomRisk:
    node: str
    seconds: float
    trend: Trend
    limit: float


def oom_risks(state: PlannerState, members: tuple[str, ...], cfg: PlannerConfig) -> list[OomRisk]:
    """Members whose memory trend (this round only) crosses the threshold within the horizon."""
    risks = []
    for m in members:
        since = state.round_active_at + cfg.round_warmup_s  # workers still loading: not a trend
        pts = [(s.t, s.mem_used) for s in state.nodes.get(m, ()) if s.t >= since]
        trend = fit_trend(pts)
        if trend is None or trend.span_s < cfg.min_trend_span_s:
            continue
        limit = cfg.oom_threshold * state.nodes[m][-1].mem_total
        if limit <= 0:
            continue
        secs = time_to_limit(trend, limit)
        # A line through a few seconds of samples says little about the next quarter hour: extrapolate at
        # most MAX_EXTRAPOLATION times the time observed (an OOM that comes sooner is still handled).
        if secs <= min(cfg.oom_horizon_s, MAX_EXTRAPOLATION * trend.span_s):
            risks.append(OomRisk(m, secs, trend, limit))
    return sorted(risks, key=lambda r: (r.seconds, r.node))


def memory_growth(state: PlannerState, members: tuple[str, ...], cfg: PlannerConfig) -> float | None:
    """Mean per-node memory slope (bytes/s, >= 0) over this round after its warm-up; None until a trend
    over at least ``min_trend_span_s`` exists."""
    slopes = []
    since = state.round_active_at + cfg.round_warmup_s
    for m in members:
        trend = fit_trend([(s.t, s.mem_used) for s in state.nodes.get(m, ()) if s.t >= since])
        if trend is not None and trend.span_s >= cfg.min_trend_span_s:
            slopes.append(trend.slope)
    return max(statistics.fmean(slopes), 0.0) if slopes else None
