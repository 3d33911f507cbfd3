"""The ``elastic-rm`` rendezvous handler: torch's ``RendezvousHandler`` on etcd v3.

How a node takes part (README.md, "How it works"):

1. It registers ``nodes/<node>`` under its own lease (kept alive by a thread; a dead node's key
   vanishes within the lease TTL) and starts the leader loop (every node campaigns; one leads).
2. ``next_rendezvous()`` marks the node ``joining`` and waits for a round that names it. It acks the
   round (rank 0 adds the address of the round's store), waits for the leader to seal it once every
   member acked, and returns its group rank (= index in the member list) and the world size.
3. While its workers run, ``num_nodes_waiting()`` is positive as soon as a newer round exists; that is
   torch's signal for the agent to stop its workers and call ``next_rendezvous()`` again.
4. A node that is not a member waits as standby; a closed job makes it exit gracefully.

Contracts kept from torch's ``api.py``: the backend name equals the registered name; errors are the
Rendezvous* exceptions; ``shutdown()`` closes the rendezvous (torch's launch_agent calls it only on a
normal exit, not when the agent dies from a signal).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import psutil
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdAuthError, EtcdError
from ..etcd.lease import KeptLease
from ..obs.events import EventLog
from ..planner.interface import NodeMetrics, NodeState, RoundPolicy
from ..planner.membership import MembershipPolicy
from ..wire.records import AckRecord, ClosedRecord, LedgerRecord, NodeRecord, RoundRecord, dumps
from .bootstrap import default_local_addr, pick_master_port
from .etcd_store import EtcdStore
from .history import build_history_record
from .leader import RoundLeader
from .settings import BACKEND, RendezvousSettings
from .view import JobView

log = logging.getLogger(__name__)

POLL_S = 0.5  # upper bound between re-checks while waiting (changes wake us at once)
ACK_RESEND_S = 2.0  # resend our ack of a round that is still unsealed after this long


def _new_node_id(host: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:64].strip("-._") or "node"
    return f"{safe}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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
        self._job = job
        self._metrics_parser = metrics_parser
        self._created = time.monotonic()
        self._client = EtcdClient(
            list(settings.endpoints),
            timeout=settings.etcd_timeout,
            tls=settings.tls,
            user=settings.user,
            password=settings.password,
        )
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
        self._host = socket.gethostname()
        self._mem_total = int(psutil.virtual_memory().total)
        self._addr = settings.local_addr or default_local_addr()
        self._node_id = settings.node_id or _new_node_id(self._host)
        self._lock = threading.RLock()
        self._lease: KeptLease | None = None
        self._incarnation = 0
        self._joined: RoundRecord | None = None  # the last round this node joined
        # A round sealed before this process first registered was made with an earlier process under the
        # same --node-id: joining it would start workers into a world the peers already left. Its number is
        # advertised instead (NodeRecord.round), so the leader sees a restart and writes a new round.
        self._registered_rev = 0  # etcd revision of this incarnation's first registration
        self._last_ack: tuple[int, bytes] | None = None  # (round, ack record) last sent
        self._stale_round = 0
        self._master_port = 0  # picked when joining; MASTER_PORT if this node becomes rank 0
        self._ckpt_endpoint = (0, "")  # the agent's checkpoint server: port and token (none: 0, "")
        self._view = JobView(self._client, self._keys, metrics_parser)
        # The run's event log in etcd; the agent attaches its --event-log file (elastic_rm.obs.events).
        self.events = EventLog(self._keys.run_id, self._node_id, client=self._client, keys=self._keys)
        try:
            self._view.start()
        except EtcdError as exc:
            self._client.close()
            raise RendezvousConnectionError(f"elastic-rm rendezvous: {exc}") from exc
        self._leader = RoundLeader(
            self._client,
            self._view,
            node_id=lambda: self._node_id,
            lease_id=lambda: None if self._lease is None or self._lease.lost else self._lease.id,
            policy=policy or MembershipPolicy(),
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            last_call_timeout=settings.last_call_timeout,
            job=job,
            events=self.events,
        )
        self._shut = False
        # The lease and the leader campaign start now, off the join path: a node that is about to
        # join needs neither a round trip for its lease nor a race for leadership while it joins.
        try:
            self._lease = KeptLease(self._client, settings.lease_ttl)
        except EtcdError as exc:
            self.release()
            raise RendezvousConnectionError(f"elastic-rm rendezvous: {exc}") from exc
        self._leader.start()

    # -- identity and liveness --------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def view(self) -> JobView:
        return self._view

    @property
    def joined_round(self) -> RoundRecord | None:
        return self._joined

    def _node_record(self, state: NodeState) -> NodeRecord:
        waiting = state in (NodeState.JOINING, NodeState.STANDBY)
        if waiting and not self._master_port:
            self._master_port = pick_master_port()
        return NodeRecord(
            node=self._node_id,
            host=self._host,
            addr=self._addr,
            pid=os.getpid(),
            nproc=self.settings.nproc,
            state=state,
            round=self._joined.round if self._joined else self._stale_round,
            cpu_count=os.cpu_count() or 0,
            mem_total_bytes=self._mem_total,
            master_port=self._master_port if waiting else 0,
            ckpt_port=self._ckpt_endpoint[0],
            ckpt_token=self._ckpt_endpoint[1],
        )

    @property
    def addr(self) -> str:
        """This node's address (its record's ``addr``): where its agent serves peers."""
        return self._addr

    def set_checkpoint_endpoint(self, port: int, token: str) -> None:
        """The agent's checkpoint server, published in this node's record from its next registration on
        (the agent calls this before the first rendezvous)."""
        self._ckpt_endpoint = (port, token)

    def checkpoint_peers(self) -> dict[str, tuple[str, int, str]]:
        """Every other alive node that serves checkpoints, members or not (a node just left out of the
        round, a replaced straggler say, still holds its shards): node -> (addr, port, token), read from
        their lease-bound records in etcd (one read, at each worker start)."""
        r = self._joined
        if r is None:
            return {}
        kvs, _ = self._client.get_prefix(self._keys.nodes)
        out = {}
        for kv in kvs:
            try:
                rec = NodeRecord.parse(kv.key, kv.value)
            except RendezvousStateError as exc:
                log.error("%s (not used as a checkpoint peer)", exc)
                continue
            if rec.node != self._node_id and rec.ckpt_port and rec.ckpt_token:
                out[rec.node] = (rec.addr, rec.ckpt_port, rec.ckpt_token)
        return out

    @property
    def leading(self) -> bool:
        """Whether this node's agent leads the run now (it may stop leading at any time)."""
        return self._leader.leading

    def publish_ledger(self, record: LedgerRecord) -> bool:
        """Mirror the checkpointed sample ledger to etcd if this node leads (fenced); see LedgerRecord."""
        return self._leader.publish_ledger(record)

    def _ensure_registered(self, state: NodeState, wait: bool = True, retry_lost_lease: int = 1) -> None:
        """(Re)register under a live lease. A node whose lease expired rejoins as a new member.

        ``wait=False`` sends the update without waiting for etcd's answer (a failure is logged; the
        lease keeps the old record meanwhile), for updates that nothing on the join path waits for.
        """
        with self._lock:
            if self._lease is not None and self._lease.lost:
                self._incarnation += 1
                old = self._node_id
                given = self.settings.node_id
                self._node_id = f"{given}-r{self._incarnation}" if given else _new_node_id(self._host)
                self._joined = None
                self._registered_rev, self._stale_round = 0, 0
                self._lease = None
                log.warning("lease of node %s expired; rejoining as %s", old, self._node_id)
                self.events.set_node(self._node_id)
                self.events.emit(
                    "node",
                    f"lease of {old} expired; rejoining as {self._node_id}",
                    old=old,
                    new=self._node_id,
                )
            if self._lease is None:
                self._lease = KeptLease(self._client, self.settings.lease_ttl)
            key, value = self._keys.node(self._node_id), dumps(self._node_record(state))
            if not wait:
                self._client.put_nowait(key, value, lease=self._lease.id)
                return
            try:
                rev = self._client.put(key, value, lease=self._lease.id)
                self._registered_rev = self._registered_rev or rev
            except EtcdError as exc:
                if "lease not found" not in str(exc) or retry_lost_lease <= 0:
                    raise
                # The lease expired before its keeper noticed (a paused or starved process): rejoin
                # as a new member now, as when the keeper reports it.
                self._lease.mark_lost()
                self._ensure_registered(state, wait, retry_lost_lease - 1)

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
        try:
            return self._next_rendezvous()
        except EtcdError as exc:
            if self._shut:  # released while waiting (a standby node told to leave)
                raise RendezvousClosedError("this rendezvous handler was shut down while waiting") from None
            raise RendezvousConnectionError(f"elastic-rm rendezvous lost etcd: {exc}") from exc

    def _next_rendezvous(self) -> RendezvousInfo:
        settings, view = self.settings, self._view
        self._check_lease()
        self._ensure_registered(NodeState.JOINING)
        deadline = time.monotonic() + settings.join_timeout
        after = self._joined.round if self._joined else 0
        acked, acked_at = 0, 0.0
        seen = -1
        state = NodeState.JOINING
        log.info("node %s joining run %s (rounds after %d)", self._node_id, self._keys.run_id, after)
        while True:
            if self._shut:
                raise RendezvousClosedError("this rendezvous handler was shut down while waiting")
            with view.cond:
                closed, error, r, r_rev = view.closed, view.error, view.round, view.round_rev
                seen = view.version
            if error is not None:
                raise error
            if closed is not None:
                raise RendezvousGracefulExitError(
                    f"run {self._keys.run_id} is closed (by {closed.by}); nothing to join"
                )
            if self._lease is not None and self._lease.lost:
                self._ensure_registered(NodeState.JOINING)
                after, acked = 0, 0
            member = r is not None and r.round > after and self._node_id in r.members
            if member and r is not None:
                if r.sealed and r_rev < self._registered_rev and self._joined is None:
                    if self._stale_round != r.round:  # sealed before we existed: ask for a new round
                        log.warning(
                            "node %s: round %d was sealed before this process registered (an earlier "
                            "process with this node id); asking for a new round",
                            self._node_id, r.round,
                        )  # fmt: skip
                        self._stale_round = r.round
                        self._ensure_registered(NodeState.JOINING)
                elif r.sealed:
                    return self._join(r)
                elif acked != r.round:
                    self._ack(r)
                    acked, acked_at = r.round, time.monotonic()
                elif time.monotonic() - acked_at > ACK_RESEND_S:
                    self._ack(r, again=True)  # a put lost in an etcd failover must not stall the round
                    acked_at = time.monotonic()
            else:
                standby = r is not None and r.round > after and r.members and self._node_id not in r.members
                wanted = NodeState.STANDBY if standby else NodeState.JOINING
                if wanted != state:
                    state = wanted
                    self._ensure_registered(state)
                if not standby and time.monotonic() > deadline:
                    raise RendezvousTimeoutError(
                        f"no round of run {self._keys.run_id} included node {self._node_id} within "
                        f"{settings.join_timeout:.0f}s (join_timeout); {self._leader.last_reason or 'no leader yet'}"
                    )
            view.wait(seen, POLL_S)

    def _ack(self, r: RoundRecord, again: bool = False) -> None:
        """Send the ack without waiting (the join path). ``again``: the round is still unsealed a while
        later: send the same ack once more (idempotent), in case etcd lost the first one."""
        if not again or self._last_ack is None or self._last_ack[0] != r.round:
            master = (self._addr, pick_master_port()) if r.members[0] == self._node_id else None
            self._last_ack = (r.round, dumps(AckRecord(node=self._node_id, master=master)))
        lease = self._lease.id if self._lease else None
        self._client.put_nowait(self._keys.ack(r.round, self._node_id), self._last_ack[1], lease=lease)

    def _join(self, r: RoundRecord) -> RendezvousInfo:
        if r.master is None:
            raise RendezvousStateError(
                f"round {r.round} in {self._keys.round} is sealed without a master address"
            )
        rank = r.members.index(self._node_id)
        view = self._view
        store = EtcdStore(
            self._client,
            self._keys.store(r.round),
            timeout=self.settings.join_timeout,
            superseded=lambda: view.round is not None and view.round.round > r.round,
        )
        self._joined = r
        self._master_port = 0  # a fresh port for the next round
        self._ensure_registered(NodeState.ACTIVE, wait=False)
        log.info("node %s: round %d, group rank %d of %d", self._node_id, r.round, rank, r.world_size)
        self.events.emit(
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

    def publish_metrics(self, value: bytes) -> None:
        """Write this node's latest metrics record (``metrics/<node>``, under the node's lease)."""
        lease = self._lease
        if self._shut or lease is None or lease.lost or self._joined is None:
            return
        self._client.put_nowait(self._keys.metric(self._node_id), value, lease=lease.id)

    def record_history(self, status: str = "completed") -> bool:
        """Leave this run's record for the warm start of later runs of the same job (planner stage 1).

        Written by the last round's rank 0 only, and only with a job description. Returns whether it wrote.
        """
        r, job = self._joined, self._job
        if not job or not job.get("tables") or r is None or not r.members or r.members[0] != self._node_id:
            return False
        metrics, cpu_counts = {}, {}
        if self._metrics_parser is not None:
            kvs, _ = self._client.get_prefix(self._keys.metrics)
            for kv in kvs:
                try:
                    metrics[self._keys.node_of(kv.key)] = self._metrics_parser(kv.key, kv.value)
                except ValueError as exc:
                    log.error("%s (left out of the history record)", exc)
        nodes, _ = self._client.get_prefix(self._keys.nodes)
        for kv in nodes:
            try:
                cpu_counts[self._keys.node_of(kv.key)] = NodeRecord.parse(kv.key, kv.value).cpu_count
            except RendezvousStateError as exc:
                log.error("%s", exc)
        record = build_history_record(
            job, self._keys.run_id, status, r, metrics, cpu_counts, time.monotonic() - self._created
        )
        self._client.put(self._keys.history(record["signature"]), json.dumps(record, sort_keys=True))
        log.info(
            "recorded run %s in history/%s for later warm starts", self._keys.run_id, record["signature"]
        )
        return True

    def _check_lease(self) -> None:
        """Ask etcd whether our lease still lives when it was not refreshed for half its TTL (we may
        have been paused): a stale node must rejoin as a new member, not act on an old round."""
        lease = self._lease
        if lease is not None and time.monotonic() - lease.last_refresh > lease.ttl / 2:
            lease.check()

    def is_closed(self) -> bool:
        return self._view.closed is not None

    def set_closed(self) -> None:
        record = ClosedRecord(by=self._node_id, time=time.time())
        try:
            self._client.put(self._keys.closed, dumps(record))
        except EtcdError as exc:
            raise RendezvousConnectionError(f"could not close run {self._keys.run_id}: {exc}") from exc
        with self._view.cond:
            self._view.closed = self._view.closed or record
            self._view.cond.notify_all()

    def num_nodes_waiting(self) -> int:
        """Positive when this node should re-rendezvous: a newer round exists or our lease is gone."""
        view = self._view
        if view.closed is not None or self._shut:
            return 0
        if self._lease is not None and self._lease.lost:
            return 1
        r, done = view.round, self._joined
        if r is None or done is None or r.round <= done.round:
            return 0
        return max(1, len(set(r.members) - set(done.members)))

    def peers_all_kept(self) -> bool:
        """Whether every member of our round is still alive for the pending round: kept in it, or left
        out of it by a planned decision while alive (the leader lists the old members it saw alive in
        the record's ``extra.alive``). Only then can our workers finish a step (a collective with a lost
        peer never returns), so only then is draining them worth waiting for."""
        return peers_kept(self._view.round, self._joined)

    def shutdown(self) -> bool:
        """Close the run (torch semantics), drop this node's keys, stop threads."""
        if self._shut:
            return True
        ok = True
        try:
            if self._view.closed is None:
                self.set_closed()
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
        self._leader.stop()
        if getattr(self, "_lease", None) is not None:
            self._lease.revoke()
        self._view.stop()
        self._client.close()


def peers_kept(pending: RoundRecord | None, done: RoundRecord | None) -> bool:
    """`peers_all_kept` for a pending round and the round our workers run in: every member of `done` is a
    member of `pending` or listed alive in its ``extra.alive``. Only the next round's list counts: a later
    round was decided without looking at `done`'s members."""
    if pending is None or done is None or pending.round <= done.round:
        return False
    alive = pending.extra.get("alive") if pending.round == done.round + 1 else None
    alive_set = {a for a in alive if isinstance(a, str)} if isinstance(alive, list) else set()
    return set(done.members) <= set(pending.members) | alive_set
