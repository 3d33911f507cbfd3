"""Membership-only round policy: torch's rendezvous semantics, decided by one leader.

Rules, in order:

1. No round yet: wait for ``min_nodes`` alive nodes; form the round at once when ``max_nodes`` are
   there, otherwise ``last_call_timeout`` after the ``min_nodes``-th node was seen.
2. A member of the current round is gone (its lease expired or was revoked): at once, a new round of
   the survivors in their old order, topped up from the waiting nodes in arrival order, if that reaches
   ``min_nodes``; otherwise wait for more nodes.
3. A member completed the current round and is joining again (its workers failed and its agent
   restarts them): at once, a new round with the same members, so that every member restarts.
4. Nodes wait outside a running round and there is room (fewer than ``max_nodes`` members): a new round
   with them appended, ``last_call_timeout`` after the first of them was seen (so that arrivals close
   together share one round).
5. Otherwise nothing changes; nodes beyond ``max_nodes`` stay standby.

Draining nodes are never put in a new round. Survivors keep their relative order, so their group
ranks change only when someone before them leaves.
"""

from __future__ import annotations

from .interface import ClusterSnapshot, Decision, NodeState, NodeView, Wait


def eligible_nodes(snapshot: ClusterSnapshot) -> list[NodeView]:
    """Alive nodes that may be members, in arrival order."""
    return sorted(snapshot.nodes, key=lambda n: n.arrival)


class MembershipPolicy:
    """Arrival order up to MAX; the default policy of the rendezvous and the planner's fallback."""

    def wanted_nodes(self) -> tuple[int, str] | None:
        """RoundPolicy: membership has no opinion on the node count (it takes the nodes that come)."""
        return None

    def model_coef(self) -> tuple[float, ...]:
        """RoundPolicy: membership fits no model."""
        return ()

    @property
    def flagged(self) -> frozenset[str]:
        """RoundPolicy: membership flags no stragglers."""
        return frozenset()

    def adopt_flagged(self, nodes: frozenset[str]) -> None:
        """RoundPolicy: membership has no use for a predecessor's flags."""

    def decide(self, snapshot: ClusterSnapshot) -> Decision | Wait:
        nodes = eligible_nodes(snapshot)
        alive = {n.node_id for n in nodes}
        current = snapshot.current
        if current is None or not current.members:
            return self._first_round(snapshot, nodes)

        survivors = [m for m in current.members if m in alive]
        waiting = [n for n in nodes if n.node_id not in set(current.members)]
        lost = len(current.members) - len(survivors)
        room = snapshot.max_nodes - len(survivors)
        if lost:
            members = survivors + [n.node_id for n in waiting[: max(room, 0)]]
            if len(members) < snapshot.min_nodes:
                # Suspend: an empty round makes the survivors stop their workers and wait for nodes.
                waiting_ids = tuple(n.node_id for n in nodes)
                return Decision(
                    (), waiting_ids, f"{lost} member(s) lost; below {snapshot.min_nodes} node(s), suspended"
                )
            standby = [n.node_id for n in waiting[max(room, 0) :]]
            return Decision(
                tuple(members), tuple(standby), f"{lost} member(s) lost; continuing with {len(members)}"
            )

        by_id = {n.node_id: n for n in nodes}
        rejoining = [
            m
            for m in current.members
            if by_id[m].state == NodeState.JOINING and by_id[m].round == current.number
        ]
        if rejoining:
            members = current.members + tuple(n.node_id for n in waiting[: max(room, 0)])
            standby = tuple(n.node_id for n in waiting[max(room, 0) :])
            return Decision(members, standby, f"node(s) {', '.join(rejoining)} restarted their workers")

        if waiting and room > 0:
            deadline = waiting[0].seen_at + snapshot.last_call_timeout
            admitted = waiting[:room]
            if snapshot.now < deadline and len(admitted) < room:
                return Wait(f"{len(waiting)} node(s) waiting; last call until {deadline:.3f}", until=deadline)
            members = survivors + [n.node_id for n in admitted]
            standby = [n.node_id for n in waiting[room:]]
            return Decision(
                tuple(members), tuple(standby), f"{len(admitted)} node(s) joined; scaling to {len(members)}"
            )
        return Wait("membership unchanged")

    @staticmethod
    def _first_round(snapshot: ClusterSnapshot, nodes: list[NodeView]) -> Decision | Wait:
        if len(nodes) < snapshot.min_nodes:
            return Wait(f"{len(nodes)} of at least {snapshot.min_nodes} node(s) present")
        members = [n.node_id for n in nodes[: snapshot.max_nodes]]
        standby = tuple(n.node_id for n in nodes[snapshot.max_nodes :])
        if len(members) < snapshot.max_nodes:
            deadline = nodes[snapshot.min_nodes - 1].seen_at + snapshot.last_call_timeout
            if snapshot.now < deadline:
                return Wait(f"{len(nodes)} node(s) present; last call until {deadline:.3f}", until=deadline)
        return Decision(tuple(members), standby, f"first round of {len(members)} node(s)")
