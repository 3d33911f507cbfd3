"""What the round policy sees: the leader's view of the run as a :class:`ClusterSnapshot` (read only).

Why a module of its own: the snapshot is the planner's whole input, read from the view alone; the
leader's loop is about its election and its fenced writes (tests/rendezvous/test_live_parity.py checks
that a live job's snapshot fills every field the simulator's does).
"""

from __future__ import annotations

import time

from ..planner.interface import ClusterSnapshot, NodeView, RoundView
from .view import JobView


def cluster_snapshot(
    view: JobView,
    min_nodes: int,
    max_nodes: int,
    last_call_timeout: float,
    job: dict,
    history: tuple[dict, ...],
    waiting_nodes: int | None,
) -> ClusterSnapshot:
    """The run as ``view`` holds it now: nodes in arrival order with their records and latest metrics,
    the current round (its decision time on the policy's monotonic clock), the job and its history."""
    with view.cond:
        nodes = tuple(
            NodeView(
                node_id=node_id,
                arrival=e.arrival,
                seen_at=e.seen_at,
                state=e.record.state,
                round=e.record.round,
                host=e.record.host,
                nproc=e.record.nproc,
                cpu_count=e.record.cpu_count,
                mem_total_bytes=e.record.mem_total_bytes,
                gpu_count=e.record.gpu_count or _gpus_in(view.metrics.get(node_id)),
                metrics=view.metrics.get(node_id),
            )
            for node_id, e in sorted(view.nodes.items(), key=lambda item: item[1].arrival)
        )
        r = view.round
    now = time.monotonic()
    # the record's unix time on the policy's clock (monotonic): the cooldown counts from the decision
    decided = now - max(time.time() - r.time, 0.0) if r is not None and r.time > 0 else 0.0
    current = None if r is None else RoundView(r.round, r.members, r.standby, decided, r.reason)
    return ClusterSnapshot(
        now=now,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        last_call_timeout=last_call_timeout,
        nodes=nodes,
        current=current,
        job=job,
        history=history,
        waiting_nodes=waiting_nodes,
    )


def _gpus_in(metrics) -> int:
    """GPUs in a node's published metrics, for records of agents older than the record's gpu_count."""
    return len(metrics.gpu_util) if metrics is not None else 0
