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
(policy.py asks it to repay two rounds), and asks for no node before it repays them. Where rounds resize
the nodes (the simulator), the give-back round carries the memory and cores to the smaller run, up to the
memory the user asked per node: a run whose budgets were cut to its lent size would otherwise keep the
loan for want of memory on fewer nodes. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from .answers import Answer, decide, standby
from .config import PlannerConfig
from .interface import ClusterSnapshot, NodeView
from .job import JobSpec
from .memory_model import estimate_node_memory, rescale_observed
from .perf_model import Fit, best_world
from .scaling import budgets, memory_floor, shape_of
from .state import Advice, PlannerState, node_capacity


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
    asked = job.request.mem_per_node_bytes
    if cfg.resize_rounds and asked > node_mem:  # the round resizes its nodes: back to the user's memory
        node_mem = asked
    growth = (state.growth_total or 0.0) / w
    strict = replace(cfg, oom_threshold=cfg.oom_threshold * 0.85)
    keep = max(keep, memory_floor(job, strict, w, per_node, growth, node_mem, keep, w))
    target = max(keep, w - waiting)
    if target >= w:
        return None, state
    advice = replace(state.advice, target_nodes=target, reason="lent nodes given back")
    if cfg.resize_rounds:  # fewer nodes hold more of the tables and feed more samples each
        advice = _budgets_at(cfg, state, job, advice, known, w, target, node_mem)
    state = replace(
        state,
        last_round_at=snapshot.now,
        moved_from=(),
        given_back=state.given_back + w - target,
        given_back_for=snapshot.waiting_nodes or 0,
        advice=advice,
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


def _budgets_at(
    cfg: PlannerConfig,
    state: PlannerState,
    job: JobSpec,
    advice: Advice,
    known: list[str],
    w: int,
    target: int,
    node_mem: float,
) -> Advice:
    """The per-node budgets of a run going from ``w`` to ``target`` nodes, never below the advice: the
    memory measured on ``w`` nodes carried to ``target`` (at most ``node_mem``), the cores scaled with
    each node's share of the batch. Without it, a run whose budgets were cut to its lent size would keep
    its loan for want of memory on fewer nodes."""
    per_node = max(state.nodes[m][-1].mem_used for m in known)
    cpu_used = max(state.nodes[m][-1].cpu_used for m in known)
    oh = cfg.cold_overhead_bytes
    per_target = rescale_observed(
        per_node, estimate_node_memory(job, w, oh), estimate_node_memory(job, target, oh)
    )
    growth = (state.growth_total or 0.0) / target
    cpu, mem = budgets(cfg, cpu_used * w / target, max(per_node, per_target), growth)
    return replace(
        advice,
        cpu_per_node=max(advice.cpu_per_node, cpu),
        mem_per_node_bytes=max(advice.mem_per_node_bytes, min(mem, node_mem)),
    )
