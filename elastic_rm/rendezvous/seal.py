"""When the leader may write a round sealed at once, skipping the ack phase (a pure rule, no I/O).

A member's ack says that it is alive and ready for the round and, from rank 0, where the workers' store
will listen. Members already waiting in ``next_rendezvous()`` (joining or standby, under a live lease) need
not say it. Nor, in a round of survivors (its members all in the current sealed round: a loss, a
scale-down), do members still active in the current round: a live registration proves them alive, their
agents join the sealed round as soon as they have stopped their workers, and every node advertises a port
for the next round in its record. Waiting for every member's ack in a large run would make the failure
round last longer than the lease TTL. Others (a node not yet registered for the current round, a newcomer
next to active members) ack first. So does a member of the current sealed round whose record still says it is
waiting for an earlier one: that record is from before it joined the current round (the update to active
is not waited for), and the port it advertises may be the one the current round's rank 0 binds now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..planner.interface import NodeState
from ..wire.records import NodeRecord, RoundRecord

WAITING = (NodeState.JOINING, NodeState.STANDBY)


def sealed_at_once(
    record: RoundRecord, members: Sequence[NodeRecord | None], current: RoundRecord | None
) -> RoundRecord:
    """``record`` sealed with rank 0's advertised address and port when no member needs to ack it, else
    ``record`` unchanged. ``members``: each member's live registration (None: none), in rank order;
    ``current``: the round it replaces."""
    if not record.members or len(members) != len(record.members):
        return record
    survivors = current is not None and current.sealed and set(record.members) <= set(current.members)

    def ready(node: NodeRecord | None) -> bool:
        if node is None:
            return False
        if node.state in WAITING:
            stale = (
                current is not None
                and current.sealed
                and node.node in current.members
                and node.round < current.round
            )  # registered before it joined the current round
            return not stale
        return (
            survivors
            and node.state == NodeState.ACTIVE
            and current is not None
            and node.round == current.round
        )

    if not all(ready(m) for m in members):
        return record
    rank0 = members[0]
    assert rank0 is not None
    if rank0.master_port <= 0:
        return record
    return replace(record, sealed=True, master=(rank0.addr, rank0.master_port))
