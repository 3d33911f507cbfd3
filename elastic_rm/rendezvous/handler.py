"""The ``elastic-rm`` rendezvous handler: torch's ``RendezvousHandler`` on etcd v3 (the round protocol).

How a node takes part (docs/agent.md and docs/design.md, "A round in etcd"):

1. It registers ``nodes/<node>`` under its own lease (kept alive by a thread; a dead node's key
   vanishes within the lease TTL) and starts the leader loop (every node campaigns; one leads).
2. ``next_rendezvous()`` marks the node ``joining`` and waits for a round that names it. It acks the
   round (rank 0 adds the address of the round's store), waits for the leader to seal it once every
   member acked, and returns its group rank (= index in the member list) and the world size. A round
   that needs no acks comes sealed at once (seal.py); a survivor of a loss joins it straight away,
   without registering as joining again.
3. While its workers run, ``num_nodes_waiting()`` is positive as soon as a newer round exists; that is
   torch's signal for the agent to stop its workers and call ``next_rendezvous()`` again.
4. A node that is not a member waits as standby; a closed job makes it exit gracefully.

What the agent needs besides the round protocol (metrics, ledger, checkpoint peers, history) is
``services``, a :class:`~elastic_rm.rendezvous.services.NodeServices` (node_services.py); this node's
identity and lease are its :class:`~elastic_rm.rendezvous.session.NodeSession` (session.py).

Contracts kept from torch's ``api.py``: the backend name equals the registered name; errors are the
Rendezvous* exceptions; ``shutdown()`` closes the rendezvous (torch's launch_agent calls it only on a
normal exit, not when the agent dies from a signal).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ..etcd.errors import EtcdAuthError, EtcdConnectionError, EtcdError
from ..planner.interface import NodeMetrics, NodeState, RoundPolicy
from ..planner.membership import MembershipPolicy
from ..wire.records import AckRecord, ClosedRecord, RoundRecord, dumps
from .backend import BACKEND
from .bootstrap import pick_master_port, port_is_free
from .etcd_store import EtcdStore
from .leader import RoundLeader
from .node_services import RendezvousNodeServices
from .peer_probe import PeerProbe
from .services import NodeServices
from .session import NodeSession
from .settings import RendezvousSettings
from .view import JobView

log = logging.getLogger(__name__)

POLL_S = 0.5  # upper bound between re-checks while waiting (changes wake us at once)
ACK_RESEND_S = 2.0  # resend our ack of a round that is still unsealed after this long
RETRY_S = 0.5  # after an etcd call that timed out on the join path, before the join starts over


def closed_by_member(view: JobView, r: RoundRecord) -> str | None:
    """Who closed the run, when a member of round ``r`` did (an agent whose workers failed closes it as it
    exits: the others' waits in the round's store end then); None otherwise (`erm stop` closes a run
    before its agents reach the exit barrier: they still wait there for each other)."""
    closed = view.closed
    return closed.by if closed is not None and closed.by in r.members else None


class ElasticRMRendezvousHandler(RendezvousHandler):
    def __init__(
        self,
        settings: RendezvousSettings,
        policy: RoundPolicy | None = None,
        job: dict | None = None,
        metrics_parser: Callable[[str, bytes], NodeMetrics] | None = None,
    ):
        """``policy`` decides rounds when this node leads (default: MembershipPolicy); ``job`` is the
        planner's job description; ``metrics_parser`` turns a ``metrics/<node>`` value into NodeMetrics
        for the policy (None: the leader does not follow metrics)."""
        self.settings = settings
        self._keys = settings.keys
        self._client = settings.etcd_client()
        try:
            self._client.ping(self._keys.run)  # only the run's prefix: a role may grant just that
        except EtcdAuthError as exc:
            self._client.close()
            raise RendezvousConnectionError(
                f"elastic-rm rendezvous: {exc}; the etcd user {settings.user!r} needs a role with "
                f"read-write permission on the prefix {self._keys.run}"
            ) from None
        except EtcdError as exc:
            self._client.close()
            raise RendezvousConnectionError(f"elastic-rm rendezvous: {exc}") from exc
        self._session = NodeSession(self._client, settings)
        self._last_ack: tuple[int, bytes] | None = None  # (round, ack record) last sent
        self._waiting: tuple = (None, None, 0)  # (round, joined round, num_nodes_waiting) last counted
        self._view = JobView(self._client, self._keys, metrics_parser)
        try:
            self._view.start()
        except EtcdError as exc:
            self._client.close()
            raise RendezvousConnectionError(f"elastic-rm rendezvous: {exc}") from exc
        self._leader = RoundLeader(
            self._client,
            self._view,
            node_id=lambda: self._session.node_id,
            lease_id=self._session.live_lease_id,
            policy=policy or MembershipPolicy(),
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            last_call_timeout=settings.last_call_timeout,
            job=job,
            events=self._session.events,
        )
        self._shut = False
        self._seen_open = False  # this process saw the run open at least once (_closed_error)
        self._probe: PeerProbe | None = None
        self.services: NodeServices = RendezvousNodeServices(
            self._client, self._session, self._view, self._leader, self.release, job, metrics_parser
        )
        # The lease and the leader campaign start now, off the join path: a node that is about to
        # join needs neither a round trip for its lease nor a race for leadership while it joins.
        try:
            self._session.start_lease()
        except EtcdError as exc:
            self.release()
            raise RendezvousConnectionError(f"elastic-rm rendezvous: {exc}") from exc
        self._leader.start()
        self._probe = self._peer_probe()

    def _peer_probe(self) -> PeerProbe | None:
        """A node that reaches etcd but not its peers leaves the run, and rejoins once it reaches them."""
        if self.settings.peer_probe_s <= 0:
            return None
        view, session = self._view, self._session

        def newer_round() -> bool:
            r, done = view.round, session.joined
            return r is not None and done is not None and r.round > done.round

        probe = PeerProbe(self._client, session, self.settings.peer_probe_s, newer_round)
        session.rejoin_gate = probe.gate
        probe.start()
        return probe

    # -- identity -------------------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._session.node_id

    @property
    def view(self) -> JobView:
        return self._view

    @property
    def joined_round(self) -> RoundRecord | None:
        """The last round this node joined (also ``services.joined_round``)."""
        return self._session.joined

    # -- RendezvousHandler ------------------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """False: the agents' store is in etcd and workers must not put their traffic there."""
        return False

    def get_run_id(self) -> str:
        return self._keys.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        if self._shut:
            raise RendezvousClosedError("this rendezvous handler was shut down")
        deadline = time.monotonic() + self.settings.join_timeout
        while True:
            try:
                return self._next_rendezvous(deadline)
            except EtcdError as exc:
                if self._shut:  # released while waiting (a standby node told to leave)
                    raise RendezvousClosedError("shut down while waiting") from None
                # a call that timed out or lost its connection (etcd stalled under load, a failover): the
                # join starts over from what the view holds, within join_timeout (every write is idempotent)
                if not isinstance(exc, EtcdConnectionError) or time.monotonic() + RETRY_S > deadline:
                    raise RendezvousConnectionError(f"elastic-rm rendezvous lost etcd: {exc}") from exc
                log.warning("node %s: %s; retrying the join", self._session.node_id, exc)
                time.sleep(RETRY_S)

    def _next_rendezvous(self, deadline: float) -> RendezvousInfo:
        settings, view, session = self.settings, self._view, self._session
        session.check_lease()
        sealed = self._sealed_for_us()
        if sealed is not None:
            info = self._join(sealed)
            if info is not None:
                return info
        session.ensure_registered(NodeState.JOINING)
        after = session.joined.round if session.joined else 0
        acked, acked_at = 0, 0.0
        seen = -1
        state = NodeState.JOINING
        log.info("node %s joining run %s (rounds after %d)", session.node_id, self._keys.run_id, after)
        while True:
            if self._shut:
                raise RendezvousClosedError("this rendezvous handler was shut down while waiting")
            with view.cond:
                closed, error, r, r_rev = view.closed, view.error, view.round, view.round_rev
                seen = view.version
            if error is not None:
                raise error
            if closed is not None:
                raise self._closed_error(closed)
            self._seen_open = True
            if session.lease_lost:
                session.ensure_registered(NodeState.JOINING)
                after, acked = 0, 0
            node_id = session.node_id
            member = r is not None and r.round > after and node_id in r.members
            if member and r is not None:
                if r.sealed and r_rev < session.registered_rev and session.joined is None:
                    if session.stale_round != r.round:  # sealed before we existed: ask for a new round
                        log.warning(
                            "node %s: round %d was sealed before this process registered (an earlier "
                            "process with this node id); asking for a new round",
                            node_id,
                            r.round,
                        )
                        session.stale_round = r.round
                        session.ensure_registered(NodeState.JOINING)
                elif r.sealed and (info := self._join(r)) is not None:
                    return info
                elif acked != r.round:
                    self._ack(r)
                    acked, acked_at = r.round, time.monotonic()
                    if not r.sealed and session.on_forming_round is not None:
                        session.on_forming_round(r)  # the agent may start its workers now (prepared.py)
                elif time.monotonic() - acked_at > ACK_RESEND_S:
                    self._ack(r, again=True)  # a put lost in an etcd failover must not stall the round
                    acked_at = time.monotonic()
            else:
                standby = r is not None and r.round > after and r.members and node_id not in r.members
                wanted = NodeState.STANDBY if standby else NodeState.JOINING
                if wanted != state:
                    state = wanted
                    session.ensure_registered(state)
                if not standby and time.monotonic() > deadline:
                    why = self._leader.last_reason or "no leader yet"
                    raise RendezvousTimeoutError(
                        f"no round of run {self._keys.run_id} included node {node_id} within "
                        f"{settings.join_timeout:.0f}s (join_timeout); {why}"
                    )
            view.wait(seen, POLL_S)

    def _sealed_for_us(self) -> RoundRecord | None:
        """A newer round, already sealed, that names this node: the leader writes the survivors' round of a
        loss sealed at once (leader.py, ``_sealed_at_once``). A survivor joins it without registering as
        joining first: in a large run that registration and the ack would be most of the survivors'
        re-join."""
        session, view = self._session, self._view
        done = session.joined
        if done is None or session.lease_lost:
            return None
        with view.cond:
            r, blocked = view.round, view.error is not None or view.closed is not None
        if blocked or r is None or not r.sealed or r.round <= done.round or session.node_id not in r.members:
            return None
        return r

    def _ack(self, r: RoundRecord, again: bool = False) -> None:
        """Send the ack without waiting (the join path). ``again``: the round is still unsealed a while
        later: send the same ack once more (idempotent), in case etcd lost the first one."""
        node_id = self._session.node_id
        if not again or self._last_ack is None or self._last_ack[0] != r.round:
            master = (self._session.addr, self._advertised_port()) if r.members[0] == node_id else None
            self._last_ack = (r.round, dumps(AckRecord(node=node_id, master=master)))
        lease = self._session.lease
        self._client.put_nowait(
            self._keys.ack(r.round, node_id), self._last_ack[1], lease=lease.id if lease else None
        )

    def _advertised_port(self) -> int:
        """Rank 0's MASTER_PORT: the port its record advertises (a joining node predicts its workers'
        environment from it), unless something took it meanwhile."""
        session = self._session
        if not session.master_port or not port_is_free(session.master_port):
            session.master_port = pick_master_port()
        return session.master_port

    def _join(self, r: RoundRecord) -> RendezvousInfo | None:
        """Join sealed round ``r``; None when this node's lease is gone (etcd dropped its key: the round
        will be replaced, and the caller rejoins as a new member)."""
        if r.master is None:
            raise RendezvousStateError(
                f"round {r.round} in {self._keys.round} is sealed without a master address"
            )
        session = self._session
        rank = r.members.index(session.node_id)
        view = self._view
        with session.lock:
            if session.lease_lost:
                log.warning("node %s: lease lost before round %d; rejoining", session.node_id, r.round)
                return None
            joined_before, port_before = session.joined, session.master_port
            session.joined = r
            session.next_master_port(avoid=r.master[1])  # advertised for the next round (ours is in use)
            # Registered as active and the "round" event in one etcd request, not waited for (1,000 nodes
            # make theirs at once, while etcd still sends the round to the rest).
            active = session.registration(NodeState.ACTIVE)
            if active is None and session.lease is not None:  # lost since the check above
                session.joined, session.master_port = joined_before, port_before
                return None
        store = EtcdStore(
            self._client,
            self._keys.store(r.round),
            timeout=self.settings.join_timeout,
            superseded=lambda: view.round is not None and view.round.round > r.round,
            closed=lambda: closed_by_member(view, r),
        )
        if active is None:
            session.ensure_registered(NodeState.ACTIVE, wait=False)
        log.info("node %s: round %d, group rank %d of %d", session.node_id, r.round, rank, r.world_size)
        session.events.emit_with(
            [active] if active else [],
            "round",
            f"joined round {r.round} as group rank {rank} of {r.world_size}",
            round=r.round,
            rank=rank,
            world=r.world_size,
        )
        return RendezvousInfo(
            store,
            rank,
            r.world_size,
            RendezvousStoreInfo(master_addr=r.master[0], master_port=r.master[1]),
        )

    def _closed_error(self, closed: ClosedRecord) -> RendezvousError:
        """A closed run sends a node home gracefully (exit 0): a standby at the job's end, a node that
        arrived late. A process that never saw the run open and finds it closed after a failure or an
        `erm stop` is most likely the job started again under the same run id: it fails, saying so,
        rather than exit 0 having run nothing (a run id names one run). A node that erm launch started
        (ERM_LAUNCH_HOST set) may come up after the run it was started for ended: it exits gracefully,
        the launcher decides about its nodes."""
        saw_it_open = self._seen_open or self._session.joined is not None
        launched = bool(os.environ.get("ERM_LAUNCH_HOST"))
        if saw_it_open or launched or closed.outcome not in ("failed", "stopped"):
            return RendezvousGracefulExitError(
                f"run {self._keys.run_id} is closed (by {closed.by}); nothing to join"
            )
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(closed.time)) if closed.time else "?"
        return RendezvousClosedError(
            f"run {self._keys.run_id} ended ({closed.outcome}, closed by {closed.by} at {when}) before "
            f"this node started. A run id names one run: start the job again with a new --rdzv-id, or "
            f"delete the old run's keys first (etcdctl del --prefix {self._keys.run})"
        )

    def is_closed(self) -> bool:
        return self._view.closed is not None

    def set_closed(self, outcome: str = "") -> None:
        """Close the run; ``outcome`` (succeeded, failed, stopped) tells a process started later under
        this run id whether the job it finds closed ran to its end (_closed_error)."""
        record = ClosedRecord(by=self._session.node_id, time=time.time(), outcome=outcome)
        try:
            self._client.put(self._keys.closed, dumps(record))
        except EtcdError as exc:
            raise RendezvousConnectionError(f"could not close run {self._keys.run_id}: {exc}") from exc
        self._view.note_closed(record)

    def num_nodes_waiting(self) -> int:
        """Positive when this node should re-rendezvous: a newer round exists or our lease is gone."""
        view = self._view
        if view.closed is not None or self._shut:
            return 0
        if self._session.lease_lost:
            return 1
        r, done = view.round, self._session.joined
        if r is None or done is None or r.round <= done.round:
            return 0
        cached = self._waiting
        if cached[0] is not r or cached[1] is not done:  # torch asks ten times a second: count once
            self._waiting = cached = (r, done, max(1, len(set(r.members) - set(done.members))))
        return cached[2]

    def shutdown(self, outcome: str = "") -> bool:
        """Close the run (torch semantics; ``outcome`` as in set_closed), drop this node's keys, stop
        threads."""
        if self._shut:
            return True
        ok = True
        try:
            if self._view.closed is None:
                self.set_closed(outcome)
        except RendezvousConnectionError as exc:
            log.warning("%s", exc)
            ok = False
        self.release()
        return ok

    def release(self) -> None:
        """Leave without closing the run (a node that drains, or a test that kills a node)."""
        if self._shut:
            return
        self._shut = True
        self._session.released = True
        self._leader.stop()
        if self._probe is not None:
            self._probe.stop()
        if self._session.lease is not None:
            self._session.lease.revoke()
        self._view.stop()
        self._client.close()
