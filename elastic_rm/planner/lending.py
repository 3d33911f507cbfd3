"""Nodes past the request are lent: taken back at once when other jobs wait for nodes.

Why a rule of its own, ahead of the cooldown: a node a job holds past its user's request is capacity the
shared cluster lends while nobody asks for it. A job that arrives and waits behind it pays for the loan,
and the user who waits was promised nothing about it; the lender was. So the loan is called in at the
first decision that sees waiting demand (``waiting_nodes`` > 0), without waiting for the cooldown or a
profiling window: at most as many nodes as wait, less those already given back to the same queue (its
count stays up until the waiting job starts), never below the request, the memory floor or the size an OOM
showed the memory fits on, and only the nodes that do not clear ``queued_node_gain`` on the job's model
(all of them without a model). The nodes given back are neither members nor standby of the new round: a
launcher keeps both, and the waiting job needs the node freed.
Nodes taken past the request while the cluster queued are judged the same way as soon as they are
measured: they were taken on the model's prediction, and the measurement decides whether they stay.
The lender knew it might be called in: a scale-up past the request pays for its round back as well
(policy.py asks it to repay two rounds). Pure.
"""

from __future__ import annotations

from dataclasses import replace

from .answers import Answer, decide, standby
from .config import PlannerConfig
from .interface import ClusterSnapshot, NodeView
from .job import JobSpec
from .perf_model import Fit, best_world
from .scaling import memory_floor, shape_of
from .state import PlannerState, node_capacity


def settle_loans(state: PlannerState, waiting: int) -> PlannerState:
    """The nodes given back still answer the queue while its count stays; as it falls (a waiting job
    started), that many given-back nodes were taken up; with no queue, none are owed."""
    if not state.given_back and not state.given_back_for:
        return state
    if waiting <= 0:
        return replace(state, given_back=0, given_back_for=0)
    taken = max(state.given_back_for - waiting, 0)
    return replace(state, given_back=max(state.given_back - taken, 0), given_back_for=waiting)


def reclaim_check(
    cfg: PlannerConfig,
    snapshot: ClusterSnapshot,
    state: PlannerState,
    job: JobSpec,
    members: tuple[str, ...],
    healthy: list[str],
    nodes: list[NodeView],
    fit: Fit | None,
) -> tuple[Answer | None, PlannerState]:
    """A round without the lent nodes other jobs wait for, else (None, state)."""
    waiting = max((snapshot.waiting_nodes or 0) - state.given_back, 0)
    request = job.request.nodes if job.request else 0
    w = len(members)
    floor = max(request, snapshot.min_nodes, 1, state.fit_nodes)
    if waiting <= 0 or request <= 0 or w <= floor:
        return None, state
    known = [m for m in members if state.nodes.get(m)]
    if not known:  # no member measured yet: the memory floor is unknown, so nothing is given back
        return None, state
    by_id = {n.node_id: n for n in nodes}
    keep = floor
    if fit is not None:
        cap = sum(node_capacity(by_id[m]) for m in members) / w
        keep = max(keep, best_world(fit, shape_of(job), cap, keep, w, cfg.queued_node_gain)[0])
    # never below what the memory needs, with the scale-down's headroom; members not measured yet hold
    # as much as the measured ones (the same shards)
    per_node = max(state.nodes[m][-1].mem_used for m in known)
    node_mem = min(
        [state.nodes[m][-1].mem_total for m in known]
        + [by_id[m].mem_total_bytes for m in members if m in by_id]
    )
    growth = (state.growth_total or 0.0) / w
    strict = replace(cfg, oom_threshold=cfg.oom_threshold * 0.85)
    keep = max(keep, memory_floor(job, strict, w, per_node, growth, node_mem, keep, w))
    target = max(keep, w - waiting)
    if target >= w:
        return None, state
    state = replace(
        state,
        last_round_at=snapshot.now,
        moved_from=(),
        given_back=state.given_back + w - target,
        given_back_for=snapshot.waiting_nodes or 0,
        advice=replace(state.advice, target_nodes=target, reason="lent nodes given back"),
    )
    reason = (
        f"scale down {w} -> {target}: {waiting} node(s) wanted by queued jobs; nodes lent past the "
        f"request of {request} given back at once"
    )
    spare = standby(healthy, state.flagged, cfg.standby_max)
    gain = None
    if fit is not None:
        shape = shape_of(job)
        gain = fit.throughput(shape, target, cap) / fit.throughput(shape, w, cap) - 1
    return decide(state, snapshot.current.number, members[:target], spare, reason, gain, 0.9)
