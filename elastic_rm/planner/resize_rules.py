"""Stage 3's resize rule: a same-members round that applies new per-node budgets (only where rounds resize).

Why apart from policy.py: it weighs the advice against what the nodes hold, in both directions: budgets
that shrink by ``resize_when_saving`` free a share of the cluster (only while other jobs wait for it: the
round costs this job a restart), and starved nodes (budgets: 1.5x the
cores of a node that uses them all) get cores. A warm start's CPU from runs at another size, or a model's
estimate, can leave a node's input pipeline short of cores for the whole run otherwise (the simulator's
right-sized family: a job at 2.3x its run time on about a quarter of the cores it had asked for). Pure.
"""

from __future__ import annotations

from dataclasses import replace

from .answers import Answer, decide, standby
from .config import PlannerConfig
from .interface import ClusterSnapshot, NodeView
from .state import PlannerState


def resize_check(
    cfg: PlannerConfig,
    snapshot: ClusterSnapshot,
    state: PlannerState,
    members: tuple[str, ...],
    healthy: list[str],
    nodes: list[NodeView],
) -> tuple[Answer | None, PlannerState]:
    """A resize round when budgets shrink enough or nodes are starved, else (None, state). A raise of
    cores is asked once per level: one the cluster could not grant is not repeated at every cooldown."""
    if not cfg.resize_rounds:
        return None, state
    by_id = {n.node_id: n for n in nodes}
    a = state.advice
    alloc_cpu = min(by_id[m].cpu_count for m in members)
    alloc_mem = min(by_id[m].mem_total_bytes for m in members)
    cpu_save = 0 < a.cpu_per_node < (1 - cfg.resize_when_saving) * alloc_cpu
    mem_save = (
        state.growth_total is not None and 0 < a.mem_per_node_bytes < (1 - cfg.resize_when_saving) * alloc_mem
    )
    cpu_grow = a.cpu_per_node >= (1 + cfg.resize_when_saving) * alloc_cpu and a.cpu_per_node > state.cpu_asked
    queues = (snapshot.waiting_nodes or 0) > 0 or snapshot.now - state.queued_at < cfg.queue_memory_s
    if not queues:  # a saving round costs this job a restart; what it frees, nobody waits for (promise.py)
        cpu_save = mem_save = False
    if not (cpu_save or mem_save or cpu_grow):
        return None, state
    state = replace(
        state,
        last_round_at=snapshot.now,
        mem_asked=a.mem_per_node_bytes if mem_save else state.mem_asked,
        cpu_asked=a.cpu_per_node if cpu_grow else state.cpu_asked,
    )
    gib = a.mem_per_node_bytes / 2**30
    why = "starved nodes get cores" if cpu_grow and not (cpu_save or mem_save) else "observed peak + margins"
    reason = f"resize to {a.cpu_per_node:.1f} cores, {gib:.1f} GiB per node ({why})"
    spare = standby(healthy, state.flagged, cfg.standby_max)
    return decide(state, snapshot.current.number, members, spare, reason, 0.0, 0.8)
