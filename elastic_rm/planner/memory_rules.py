"""Stage 3's memory rule: an OOM that happened, or one the memory trend predicts, gets more memory or more
nodes (tables shard thinner).

Why apart from policy.py: it is the one rule that weighs memory against nodes (with resizable rounds,
memory is cheaper than a node; when a raise did not take, or without resizable rounds, shard thinner).
An OOM after a raise that took only up to the node's size (the node grew, short of the ask: it will not
grow more), with no node to shard onto, suspends the run until the nodes its memory fits on are there
(``PlannerState.fit_nodes``): restarting on the same nodes only repeats the OOM until the restarts run
out, and a job that started below its request (the cluster had fewer nodes free) then failed where the
user's own configuration, waiting for its nodes, completed. So does such an OOM of a run below its start
size (the cluster gave it fewer nodes than its memory was planned for) when the raise, asked again, did
not take again (a raise that takes, or a run that shards, starts that count over). A raise that did not
take at all (the machine had no room then) on a run at its start size is asked again:
room may come, and a suspended job holds its nodes idle.
Pure: the answer and the new state from the snapshot and the old state.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from .answers import Answer, decide, standby
from .config import PlannerConfig
from .interface import ClusterSnapshot, NodeView, Wait
from .job import JobSpec
from .promise import round_cost
from .runtime import oom_risks
from .scaling import memory_floor, memory_forecast
from .state import PlannerState


def oom_check(
    cfg: PlannerConfig,
    snapshot: ClusterSnapshot,
    state: PlannerState,
    job: JobSpec,
    members: tuple[str, ...],
    healthy: list[str],
    nodes: list[NodeView],
) -> tuple[Answer | None, PlannerState]:
    """An OOM happened (``job["oom_count"]`` grew) or the trend crosses the threshold soon: an answer;
    else None and the state unchanged."""
    by_id = {n.node_id: n for n in nodes}
    w = len(members)
    node_mem = min((by_id[m].mem_total_bytes for m in members if m in by_id), default=0)
    resize_failed = state.mem_asked > 0 and node_mem < 0.99 * state.mem_asked
    if not resize_failed and state.mem_reasks:  # the raise took (or none is pending): a later one starts over
        state = replace(state, mem_reasks=0)
    # the raise took in part (the node grew, short of the ask): it is as large as it gets; a raise that
    # did not take at all may take later, when the machine has room again
    capped = resize_failed and state.mem_asked_from > 0 and node_mem > 1.01 * state.mem_asked_from
    # a run the cluster started short of its start size has a size its memory was planned for: an OOM
    # whose raise did not take when asked again either waits for those nodes, as the user's own
    # configuration would have
    start = getattr(state.start, "world", 0)
    capped = capped or (resize_failed and w < start and state.mem_reasks > 0)
    ask = partial(
        more_memory,
        cfg,
        snapshot,
        job=job,
        members=members,
        healthy=healthy,
        resize_failed=resize_failed,
        node_mem=node_mem,
    )
    ooms = int(snapshot.job.get("oom_count", 0) or 0)
    if ooms > state.ooms_seen:
        state = replace(state, ooms_seen=ooms)
        level = max((state.nodes[m][-1].mem_used for m in members if m in state.nodes), default=node_mem)
        growth = (state.growth_total or 0.0) / w
        need = max(
            node_mem * cfg.oom_restart_factor,
            (level + growth * cfg.mem_growth_horizon_s) * (1 + cfg.mem_margin),
        )
        why = f"OOM happened at {node_mem / 2**30:.1f} GiB per node"
        return ask(state=state, need=need, why=why, capped=capped)
    # a job is expected to run about as long as it has run: an OOM further ahead than that (and than the
    # next look plus a round) may never come, and raising memory for it costs a round now
    ahead = max(snapshot.now - state.first_round_at, cfg.sample_interval_s + round_cost(cfg, state))
    risks = [r for r in oom_risks(state, members, cfg) if r.seconds <= ahead]
    if not risks:
        return None, state
    r = risks[0]
    growth = max(r.trend.slope, (state.growth_total or 0.0) / w)
    need = (r.trend.level + growth * cfg.mem_growth_horizon_s) * (1 + cfg.mem_margin)
    why = (
        f"OOM predicted on {r.node} in {r.seconds:.0f} s "
        f"({r.trend.level / 2**30:.1f} GiB, +{growth * 3600 / 2**30:.2f} GiB/h)"
    )
    return ask(state=state, need=need, why=why, level=r.trend.level, growth=growth)


def more_memory(
    cfg: PlannerConfig,
    snapshot: ClusterSnapshot,
    state: PlannerState,
    job: JobSpec,
    members: tuple[str, ...],
    healthy: list[str],
    need: float,
    why: str,
    resize_failed: bool,
    level: float = 0.0,
    growth: float = 0.0,
    capped: bool = False,
    node_mem: float = 0.0,
) -> tuple[Answer, PlannerState]:
    """`need` bytes per node: a larger memory budget (resizable rounds), else enough nodes to fit; an OOM
    after a raise that took only up to the node's size (``capped``), with no node to add: the run waits
    for them. ``node_mem``: the members' memory now."""
    w = len(members)
    cur = snapshot.current
    assert cur is not None, "the memory rule runs only while a round runs"
    spare = standby(healthy, state.flagged, cfg.standby_max)
    if cfg.resize_rounds and not resize_failed:
        state = replace(
            state,
            mem_asked=need,
            mem_asked_from=node_mem,
            last_round_at=snapshot.now,
            advice=replace(
                state.advice, mem_per_node_bytes=max(need, state.advice.mem_per_node_bytes), reason=why
            ),
        )
        reason = f"{why}; memory budget to {need / 2**30:.1f} GiB per node"
        return decide(state, cur.number, members, spare, reason, 0.0, 0.7)
    per_node = level or max((state.nodes[m][-1].mem_used for m in members if m in state.nodes), default=0.0)
    node_mem = min(state.nodes[m][-1].mem_total for m in members if m in state.nodes) if per_node else 0.0
    floor = memory_floor(job, cfg, w, per_node, growth, node_mem, w + 1, snapshot.max_nodes)
    state = replace(
        state,
        advice=replace(state.advice, target_nodes=max(floor, state.advice.target_nodes), reason=why),
    )
    add = min(floor - w, len(healthy))
    if add <= 0 and capped and floor > w:
        return suspend_until_fit(cfg, cur.number, state, job, members, floor, per_node, growth, why)
    if add <= 0 and cfg.resize_rounds:  # no node to add: ask for memory again all the same
        state = replace(state, mem_asked=need, last_round_at=snapshot.now, mem_reasks=state.mem_reasks + 1)
        state = replace(
            state,
            advice=replace(state.advice, mem_per_node_bytes=max(need, state.advice.mem_per_node_bytes)),
        )
        reason = f"{why}; memory budget to {need / 2**30:.1f} GiB per node"
        return decide(state, cur.number, members, spare, reason, 0.0, 0.5)
    if add <= 0:
        return Wait(f"{why}; no node to add, asking for {floor} node(s)"), state
    new = list(members) + healthy[:add]
    state = replace(state, last_round_at=snapshot.now, mem_asked=0.0, mem_reasks=0)
    reason = f"{why}; sharding over {len(new)} nodes"
    return decide(
        state, cur.number, new, standby(healthy[add:], state.flagged, cfg.standby_max), reason, None, 0.7
    )


def suspend_until_fit(
    cfg: PlannerConfig,
    cur_number: int,
    state: PlannerState,
    job: JobSpec,
    members: tuple[str, ...],
    floor: int,
    per_node: float,
    growth: float,
    why: str,
) -> tuple[Answer, PlannerState]:
    """An empty round (the run suspends; its nodes wait as standby) until ``floor`` nodes are there, with
    the memory budget carried to that many nodes (the raise asked for on fewer is dropped: new nodes get
    slices they can be given)."""
    at_floor = memory_forecast(job, cfg, len(members), per_node, growth, floor) if per_node else 0.0
    mem = at_floor * (1 + cfg.mem_margin)
    advice = replace(
        state.advice,
        target_nodes=max(floor, state.advice.target_nodes),
        mem_per_node_bytes=mem or state.advice.mem_per_node_bytes,
        reason=why,
    )
    state = replace(state, fit_nodes=floor, mem_asked=0.0, advice=advice)
    reason = (
        f"{why}; the node took the raise only in part and no node is free: "
        f"suspended until {floor} node(s) are here"
    )
    return decide(state, cur_number, (), members, reason, None, 0.7)
