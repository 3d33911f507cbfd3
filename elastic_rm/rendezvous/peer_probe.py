"""A node that reaches etcd but not its peers steps out of the run, and comes back once it reaches them.

Why: with its link to the other hosts cut but etcd reachable, a node keeps its lease, so no round ever
leaves it out; every member then waits in gloo collectives for minutes. Each node probes the checkpoint
servers of a sample of its round's other members (elastic_rm.rendezvous.peer_sockets: a TCP connect, every
``PROBE_INTERVAL_S``). When the quorum rules say it is cut off (elastic_rm.rendezvous.peer_quorum: more
than half of at least 2 peers fail every probe of them for the window, ``--rdzv-conf peer_probe``, or a
tie it loses), the node revokes its own lease: the leader sees a lost member, the others train on without
it, and its agent stops its workers and rejoins, once the rejoin gate lets it
(elastic_rm.rendezvous.rejoin_gate). A peer that is gone from etcd does not count (its lease ended: the
leader replaces it anyway). A peer whose host refuses the connect (nothing listens there: its agent is
dead) is also reported, and its lease revoked once a quorum of probers agrees (dead_peers.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..background import Background
from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from .dead_peers import RefusalReports
from .peer_quorum import TIE_WINDOWS, CutOffClock, cut_off, outranked, ranked_before
from .peer_sockets import (
    CONNECT_TIMEOUT_S,
    OK,
    REFUSED,
    Target,
    live_targets,
    probe_outcomes,
    read_targets,
    resample,
)
from .rejoin_gate import wait_to_rejoin
from .session import NodeSession

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
# after a refused connect, the next probe comes this soon: a dead peer is reported (dead_peers.py) without
# waiting a whole interval, while a healthy run costs each node one round of connects a second
CONFIRM_S = 0.2


class PeerProbe:
    """Probes this node's round peers while it trains; steps out when cut off; gates its rejoin."""

    def __init__(
        self,
        client: EtcdClient,
        session: NodeSession,
        window_s: float,
        newer_round: Callable[[], bool],
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        """``newer_round``: whether a round after the joined one is pending (then no step-out is needed)."""
        self._client = client
        self._session = session
        self._nodes = session.settings.keys.nodes
        self._newer_round = newer_round
        self._interval_s = interval_s
        self.clock = CutOffClock(window_s)
        self.refusals = RefusalReports(client, session)  # peers refused: dead, revoked early (dead_peers.py)
        self._leases: dict[str, int] = {}  # each target's lease, as its record was read
        self._members: set[str] = set()  # the round peers the targets were sampled from
        self._lost: set[str] = set()  # the targets that did not answer the last probe
        # the rule held at the last probe: a node whose peers revoked its lease (dead_peers.py) while it
        # could not reach them is gated like one that stepped out
        self.cut_now = False
        self.stepped_out = threading.Event()
        self._thread = Background(self._loop, "erm-peer-probe")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop(timeout_s=2 * CONNECT_TIMEOUT_S + 1)

    # -- while training -------------------------------------------------------------------------------

    def _loop(self, stopping: threading.Event) -> None:
        round_seen, targets = 0, {}
        wait = self._interval_s
        while not stopping.wait(wait):
            try:
                round_seen, targets = self._tick(round_seen, targets)
            except EtcdError as exc:  # etcd down is not our concern here (the lease handles it)
                log.debug("peer probe: %s", exc)
            except Exception:  # noqa: BLE001 - a probe must never take the node down
                log.exception("peer probe failed")
            wait = CONFIRM_S if self.refusals.confirming else self._interval_s

    def _tick(self, round_seen: int, targets: dict[str, Target]) -> tuple[int, dict[str, Target]]:
        session = self._session
        joined = session.joined
        if session.released or joined is None or session.live_lease_id() is None or self.stepped_out.is_set():
            self.clock.reset()
            return 0, {}
        if joined.round != round_seen:
            self.clock.reset()
            self.refusals.reset()
            targets = self._resample([m for m in joined.members if m != session.node_id], targets)
            round_seen = joined.round
        outcomes = probe_outcomes(targets)
        lost = self._lost = {n for n, outcome in outcomes.items() if outcome != OK}
        self.refusals.observe(joined.members, {n for n in lost if outcomes[n] == REFUSED}, self._leases)
        earlier = ranked_before(joined.members, session.node_id)
        self.cut_now = cut_off(len(targets), len(lost), bool(lost & earlier))
        if unreachable := self.clock.observe(time.monotonic(), targets, lost, earlier):
            self.clock.reset()
            self._maybe_step_out(targets, unreachable)
        return round_seen, targets

    def _resample(self, members: list[str], targets: dict[str, Target]) -> dict[str, Target]:
        """This round's targets: the last round's sample, kept where it may be, and new peers, whose records
        are read, with those of kept peers that did not answer the last probe (their record may have
        changed: a process restarted under the same node id)."""
        kept, added = resample(targets, self._members, members)
        stale = [n for n in kept if n in self._lost]
        fresh, leases = read_targets(self._client, self._nodes, added + stale, self._session.node_id)
        kept = [n for n in kept if n not in stale]
        self._leases = {n: self._leases[n] for n in kept} | leases
        self._members = set(members)
        return {n: targets[n] for n in kept} | fresh

    def _maybe_step_out(self, targets: dict[str, Target], lost: set[str]) -> None:
        """Confirm with etcd (peers gone from it do not count; a pending newer round settles it), then revoke
        this node's lease."""
        if self._newer_round():
            return
        live = set(live_targets(self._client, self._nodes, self._session.node_id))
        peers, lost = set(targets) & live, lost & live
        session, lease = self._session, self._session.lease
        if lease is None or session.joined is None:
            return
        later = outranked(session.joined.members, session.node_id, lost)
        if not cut_off(len(peers), len(lost), later):
            return
        tie = not cut_off(len(peers), len(lost))  # it leaves by the tie-break, not by a majority
        window = self.clock.window_s * (TIE_WINDOWS if tie else 1)
        why = (
            " (a tie: a peer it cannot reach ranks before it in the round, so this node leaves)"
            if tie
            else ""
        )
        message = (
            f"cannot reach {len(lost)} of {len(peers)} peers ({', '.join(sorted(lost))}) for {window:g}s "
            f"while etcd answers{why}: leaving the run (revoking this node's lease); it rejoins once it "
            "reaches them"
        )
        log.warning("node %s %s", session.node_id, message)
        session.events.emit("node", message, unreachable=sorted(lost), peers=len(peers), window_s=window)
        self.stepped_out.set()
        lease.revoke()

    # -- before rejoining -----------------------------------------------------------------------------

    def gate(self) -> None:
        """Called before a node whose lease is gone registers again: after a step-out, wait until it reaches
        more than half of the run's other live nodes (elastic_rm.rendezvous.rejoin_gate); so too when its
        last probe found it cut off (its peers may have revoked its lease first: dead_peers.py). Returns at
        once for a lease lost any other way."""
        if not self.stepped_out.is_set() and not self.cut_now:
            return
        wait_to_rejoin(self._client, self._session, self._interval_s)
        self.stepped_out.clear()
        self.cut_now = False
