"""The seam between the agent and the rendezvous: what an agent needs from its node's place in the run.

Why a declared Protocol: names looked up on the handler by string would let a renamed method silently
turn a feature off. The agent is given a ``NodeServices`` (or None under torch's own
backends, decided once by :func:`elastic_rm.rendezvous.registration.node_services`) and calls it
directly; ``tests/rendezvous/test_services.py`` checks that the implementation has every member below
with a compatible signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..checkpoint.peer_tls import PeerTls
from ..obs.events import EventLog
from ..wire.records import LedgerRecord, NodeRecord, RoundRecord

# What an agent without node services (torch's own rendezvous backends) runs without; it logs this.
WITHOUT_SERVICES = (
    "metrics in etcd (the planner sees no node), the checkpoint server and checkpoint peers (restores use "
    "local memory and the durable copy), the ledger mirror, the run's history record, the membership grace "
    "(a lost peer's failure uses a restart) and the drain's lost-peer check"
)


class NodeServices(Protocol):
    """This node's services in an elastic-rm run. Every member is safe to call from any thread."""

    @property
    def node_id(self) -> str:
        """This node's id in the run; it changes when the node rejoins after losing its lease."""
        ...

    @property
    def addr(self) -> str:
        """This node's address (its record's ``addr``): where its agent serves peers."""
        ...

    @property
    def events(self) -> EventLog:
        """The run's event log in etcd; the agent attaches its ``--event-log`` file to it."""
        ...

    @property
    def lease_ttl(self) -> float:
        """Seconds a dead node keeps its key: how long a lost peer may take to show as a new round."""
        ...

    @property
    def joined_round(self) -> RoundRecord | None:
        """The last round this node joined (None before the first, and after it rejoined)."""
        ...

    @property
    def pending_round(self) -> RoundRecord | None:
        """The newest round of the run as this node watches it: the one forming while its workers drain
        (rounds in place read from it whether this node is still a member)."""
        ...

    @property
    def closed_by(self) -> str | None:
        """Who closed the run (its ``closed`` record's ``by``: a node id, or "erm stop"); None while open."""
        ...

    @property
    def leading(self) -> bool:
        """Whether this node leads the run now (it may stop leading at any time)."""
        ...

    def publish_metrics(self, value: bytes) -> None:
        """Write this node's latest metrics record (``metrics/<node>``), while it is a member."""
        ...

    def set_workers_in_place(self) -> None:
        """Say (in this node's record, at once) that its workers keep their processes across rounds."""
        ...

    def set_forming_round_hook(self, hook: Callable[[RoundRecord], None] | None) -> None:
        """``hook(round)`` is called on the join path once per round that names this node and is not
        sealed yet, right after this node acked it; it must not raise."""
        ...

    def node_records(self, nodes: list[str]) -> dict[str, NodeRecord]:
        """The records of ``nodes`` as this node watches them (a node without one is left out)."""
        ...

    def set_checkpoint_endpoint(self, port: int, token: str) -> None:
        """Publish the agent's checkpoint server in this node's record (from its next registration on)."""
        ...

    def set_hardware(self, gpu_count: int, gpu_model: str) -> None:
        """Publish this node's GPU count and model (the agent's monitor) in its record, for the planner."""
        ...

    @property
    def checkpoint_tls(self) -> tuple[PeerTls | None, bool]:
        """(the TLS files of the checkpoint transport, whether TLS is required): the etcd client's CA and
        pair when ``ckpt_tls`` is auto or required (checkpoint/peer_tls.py)."""
        ...

    def checkpoint_peers(self) -> dict[str, tuple[str, int, str]]:
        """Every other alive node that serves checkpoints: node -> (addr, port, token)."""
        ...

    def publish_ledger(self, record: LedgerRecord) -> bool:
        """Mirror the checkpointed sample ledger to etcd if this node leads (fenced); whether it wrote."""
        ...

    def record_history(self, status: str = "completed") -> bool:
        """Leave this run's record for the warm start of later runs (rank 0 only); whether it wrote."""
        ...

    def peers_all_kept(self) -> bool:
        """Whether every member of our round is still alive for the pending round (draining is worth it)."""
        ...

    def release(self) -> None:
        """Leave the run without closing it (an agent stopped by a signal)."""
        ...
