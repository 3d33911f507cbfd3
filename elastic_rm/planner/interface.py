"""The contract between the rendezvous leader and any round policy.

The leader builds a :class:`ClusterSnapshot` from etcd (alive nodes, their metrics, the current round)
and asks a :class:`RoundPolicy` what to do. The policy answers with a :class:`Decision` (write this
round) or a :class:`Wait` (nothing to do yet; ask again by ``until`` or on the next change).

Everything here is plain data: no etcd, no clock, no I/O. Time comes in as ``snapshot.now`` (seconds on
the leader's monotonic clock), so a policy is deterministic for a given snapshot and can be replayed in
the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class NodeState(StrEnum):
    """A node's state, as its agent registers it (``nodes/<node>`` in etcd) and the planner sees it."""

    JOINING = "joining"  # wants a place in the next round: new, or its workers failed and restarted
    ACTIVE = "active"  # a member of the sealed round it names, training
    STANDBY = "standby"  # told to wait (beyond the job's maximum); promoted when a member leaves


@dataclass(frozen=True)
class StepStats:
    """Step-time summary of one node's workers over the last publishing window."""

    p50_s: float
    p90_s: float
    samples_per_s: float
    steps: int
    busy_p50_s: float | None = None  # on-CPU + runnable time per step (None: agent without it; use p50_s)


@dataclass(frozen=True)
class NodeMetrics:
    """The latest resource sample a node's agent published (``metrics/<node>`` in etcd)."""

    cpu_util: float  # fraction of the node's cores in use, 0..1 (mean over the window)
    mem_used_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    gpu_util: tuple[float, ...] = ()  # per GPU, 0..1
    gpu_mem_used_bytes: tuple[int, ...] = ()
    gpu_throttled: bool = False
    steps: StepStats | None = None
    # per GPU, whether its device reported a utilisation (False: MIG, counted as 0.0 in gpu_util, and not
    # an idle GPU); () when every GPU did
    gpu_util_known: tuple[bool, ...] = ()


@dataclass(frozen=True)
class NodeView:
    """One alive node (its lease is held) as the leader sees it."""

    node_id: str
    arrival: int  # etcd create revision of the node key: a total order of arrival
    seen_at: float  # when the leader first saw this node (leader clock, seconds)
    state: NodeState = NodeState.JOINING
    round: int = 0  # the last round this node completed (0: none); a member that completed the
    # current round and is "joining" again wants a new round (its workers failed or restarted)
    host: str = ""
    nproc: int = 1
    cpu_count: int = 0
    mem_total_bytes: int = 0
    gpu_count: int = 0
    metrics: NodeMetrics | None = None


@dataclass(frozen=True)
class RoundView:
    """The round currently in etcd."""

    number: int
    members: tuple[str, ...]  # ordered: group rank = index
    standby: tuple[str, ...] = ()
    decided_at: float = 0.0  # leader clock when it was written (0 when unknown, e.g. a new leader)
    reason: str = ""


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything a policy may look at. Built by the leader; built by the simulator in simulations."""

    now: float
    min_nodes: int
    max_nodes: int
    last_call_timeout: float
    nodes: tuple[NodeView, ...]  # alive nodes, in arrival order
    current: RoundView | None = None
    job: dict = field(default_factory=dict)  # job signature and settings (planner-specific, JSON-like)
    history: tuple[dict, ...] = ()  # finished runs of the same job signature (warm start)
    # Nodes that other jobs of the cluster wait for (asked for, not placed): the cluster's queue. None:
    # unknown (the executor does not say; the planner keeps its rule for nodes past the request as is)
    waiting_nodes: int | None = None


@dataclass(frozen=True)
class Decision:
    """Write a new round with these members (group rank = index) and standby nodes."""

    members: tuple[str, ...]
    standby: tuple[str, ...]
    reason: str
    predicted_gain: float | None = None  # relative throughput change the policy expects (0.2 = +20%)
    confidence: float | None = None  # 0..1


@dataclass(frozen=True)
class Wait:
    """No new round now. Ask again at ``until`` (leader clock) or at the next change when None."""

    reason: str
    until: float | None = None


class RoundPolicy(Protocol):
    """Decides rounds. Must be pure: the same snapshot gives the same answer."""

    def decide(self, snapshot: ClusterSnapshot) -> Decision | Wait: ...

    def wanted_nodes(self) -> tuple[int, str] | None:
        """The node count this policy would like (target, reason), for executors that can add or release
        nodes (the leader writes it to ``demand``); None when it has no opinion."""
        ...

    def model_coef(self) -> tuple[float, ...]:
        """The model coefficients fitted on this run so far, () without a model: the leader writes them
        into each round's outcome, and the run's history record carries them to the next warm start."""
        ...

    @property
    def flagged(self) -> frozenset[str]:
        """The nodes this policy holds for stragglers: the leader writes them into every round."""
        ...

    def adopt_flagged(self, nodes: frozenset[str]) -> None:
        """Take over the straggler flags a previous leader recorded in the current round."""
        ...
