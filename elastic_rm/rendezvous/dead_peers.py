"""A peer whose host refuses its checkpoint port is dead: its lease is revoked before the TTL runs out.

Why: a crashed or SIGKILLed agent's lease lives on until its TTL ends, and until then no round leaves the
node out: the failure round waits the TTL, then the fan-out of the new round. A live
host answers a connect to a port nobody listens on at once, with a reset ("connection refused"), and the
agent's checkpoint server listens for the agent's whole life (agent/ckpt_hooks.py). So the nodes that
probe a peer (peer_probe.py) and are refused ``REFUSED_PROBES`` times in a row (the probe comes back
0.2 s after a refusal instead of a second later) report it under
``refused/<peer>/<reporter>``, naming the peer's lease (RefusedRecord, under the reporter's own lease).
The reporter whose report makes them ``enough`` (two reporters naming that lease; rank 0 alone in a round
of two) revokes it: etcd drops the peer's keys, and the leader writes the survivors' round as for any
loss.

What it leaves to the lease TTL: a connect that gets no answer (a partition, a machine gone, a firewall
that drops) is no refusal; nor is a frozen agent (SIGSTOP, a swap storm), whose kernel still accepts
connections. A process restarted under the same node id registers under a new lease, which no report of
the old one names. A node's reports are deleted when its round changes, and with its lease.
"""

from __future__ import annotations

import logging
import time

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..wire.records import RecordError, RefusedRecord, dumps
from .session import NodeSession

log = logging.getLogger(__name__)

REFUSED_PROBES = 2  # refused probes in a row (the second one CONFIRM_S after the first) before a report


def enough(members: tuple[str, ...], reporters: set[str]) -> bool:
    """Whether these reporters may take a peer's lease: two of them, so that no single node's view (a
    firewall rejecting connects on its path alone) takes a live peer out; in a round of two, where the
    other member is the only prober, group rank 0 alone (of two hosts cut apart the cut-off rule keeps
    rank 0 too: peer_probe.py)."""
    return len(reporters) >= 2 or (len(members) == 2 and members[0] in reporters)


class RefusalReports:
    """One node's reports of peers refused, and the revocation once a quorum names the same lease."""

    def __init__(self, client: EtcdClient, session: NodeSession) -> None:
        self._client = client
        self._session = session
        self._keys = session.settings.keys
        self._streak: dict[str, int] = {}  # peer -> refused probes in a row
        self._reported: set[tuple[str, int]] = set()  # (peer, lease) reported this round
        self._sent: set[str] = set()  # keys of this node's reports, deleted at the next round

    def observe(self, members: tuple[str, ...], refused: set[str], leases: dict[str, int]) -> None:
        """One probe's refused peers among this node's targets; ``leases``: each target's lease as its record
        was read; ``members``: the round's."""
        self._streak = {p: self._streak.get(p, 0) + 1 for p in refused}
        for peer in sorted(refused):
            lease = leases.get(peer, 0)
            # an etcd error leaves the peer unreported: the next probe reports it
            if self._streak[peer] >= REFUSED_PROBES and lease and (peer, lease) not in self._reported:
                self._report(peer, lease, members)

    @property
    def confirming(self) -> bool:
        """A peer was refused, not yet as often as a report needs: probe again soon (peer_probe.py)."""
        return any(0 < n < REFUSED_PROBES for n in self._streak.values())

    def reset(self) -> None:
        """A new round: the reports of the last one are done with (their peer is gone, or was not dead)."""
        self._streak, self._reported = {}, set()
        sent, self._sent = self._sent, set()
        for key in sent:
            try:
                self._client.delete(key)
            except EtcdError as exc:  # the reporter's lease drops it in the end
                log.debug("could not delete refused report %s: %s", key, exc)

    def _report(self, peer: str, lease: int, members: tuple[str, ...]) -> None:
        session = self._session
        mine = session.live_lease_id()
        if mine is None:
            return
        key = self._keys.refused(peer) + session.node_id
        record = RefusedRecord(reporter=session.node_id, lease=lease, time=time.time())
        self._client.put(key, dumps(record), lease=mine)
        self._sent.add(key)
        self._reported.add((peer, lease))
        kvs, _ = self._client.get_prefix(self._keys.refused(peer))
        reporters = set()
        for kv in kvs:
            try:
                got = RefusedRecord.parse(kv.key, kv.value)
            except RecordError as exc:
                log.error("%s (not counted)", exc)
                continue
            if got.lease == lease:
                reporters.add(got.reporter)
        if enough(members, reporters):
            try:
                self._revoke(peer, lease, sorted(reporters))
            except EtcdError:
                self._reported.discard((peer, lease))  # the next probe reports and counts again
                raise

    def _revoke(self, peer: str, lease: int, reporters: list[str]) -> None:
        """Revoke ``peer``'s lease when its record is still the one under it (else it is gone already, or
        registered again under a new lease: nothing to do)."""
        kv = self._client.get(self._keys.node(peer))
        if kv is None or kv.lease != lease:
            return
        self._client.lease_revoke(lease)
        self._client.delete(self._keys.refused(peer), prefix=True)
        message = (
            f"node {peer}'s checkpoint port refused connections from {', '.join(reporters)} (its agent is "
            "gone, its host up): revoked its lease without waiting out the "
            f"{self._session.settings.lease_ttl:g}s TTL"
        )
        log.warning("node %s: %s", self._session.node_id, message)
        self._session.events.emit("failure", message, node=peer, reporters=reporters)
