"""Builders of snapshots for planner tests (a tiny synchronous job whose step time follows the model), and
feed(), which runs them through a policy."""

from __future__ import annotations

from elastic_rm.planner.interface import ClusterSnapshot, NodeMetrics, NodeView, RoundView, StepStats
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

GIB = 1024**3

JOB = {
    "name": "unit",
    "global_batch": 8192,
    "tables": [{"rows": 1_000_000, "dim": 64}] * 4,
    "dense_params": 2_000_000,
    "bandwidth": 3.125e9,
    "request": {"nodes": 2, "cpu_per_node": 16, "mem_per_node_bytes": 64 * GIB, "gpus_per_node": 1},
}


def step_s(world: int, compute: float = 2e-5, fixed: float = 0.01) -> float:
    """A synthetic ground truth with strong diminishing returns."""
    comm = 0.02 * (world - 1) / world
    return compute * 8192 / world + comm + fixed


def node(
    nid: str,
    arrival: int,
    busy: float | None = None,
    tp: float = 0.0,
    mem_gib: float = 8.0,
    mem_total_gib: float = 64.0,
    seen_at: float = 0.0,
    throttled: bool = False,
    state: str = "active",
    gpu_util: float = 0.8,
) -> NodeView:
    steps = StepStats(busy, busy * 1.05, tp, 100) if busy is not None else None
    m = NodeMetrics(
        cpu_util=0.3,
        mem_used_bytes=int(mem_gib * GIB),
        mem_available_bytes=int((mem_total_gib - mem_gib) * GIB),
        mem_total_bytes=int(mem_total_gib * GIB),
        gpu_util=(gpu_util,),
        gpu_throttled=throttled,
        steps=steps,
    )
    return NodeView(
        nid,
        arrival,
        seen_at,
        state,
        cpu_count=16,
        mem_total_bytes=int(mem_total_gib * GIB),
        gpu_count=1,
        metrics=m,
    )


def running(
    now: float,
    members: list[str],
    extra: list[str] = (),
    number: int = 0,
    decided_at: float = 0.0,
    slow: dict[str, float] | None = None,
    mem_gib: float | dict[str, float] = 8.0,
    min_nodes: int = 1,
    max_nodes: int = 8,
    job: dict | None = None,
    history: tuple = (),
    extra_seen_at: float = 0.0,
) -> ClusterSnapshot:
    """A snapshot of a running round: members report the model's step time (times their slowdown)."""
    slow = slow or {}
    w = len(members)
    t = step_s(w) * max([1.0, *slow.values()])
    views = []
    for i, m in enumerate(members):
        mg = mem_gib[m] if isinstance(mem_gib, dict) else mem_gib
        views.append(node(m, i, busy=step_s(w) * slow.get(m, 1.0), tp=8192 / t / w, mem_gib=mg))
    for j, e in enumerate(extra):
        views.append(node(e, 100 + j, busy=None, seen_at=extra_seen_at))
    cur = RoundView(number, tuple(members), (), decided_at)
    return ClusterSnapshot(now, min_nodes, max_nodes, 30.0, tuple(views), cur, dict(job or JOB), history)


def feed(policy: PlannerPolicy, snaps, state: PlannerState | None = None):
    """Run snapshots through step(); returns the answers and the final state."""
    state = state or PlannerState()
    answers = []
    for s in snaps:
        a, state = policy.step(s, state)
        answers.append(a)
    return answers, state
