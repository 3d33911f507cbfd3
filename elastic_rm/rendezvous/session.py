"""This node's presence in a run: its id, its lease, its record under ``nodes/<node>``, the round it joined.

Why a module of its own: the round protocol (handler.py) and the node services (node_services.py) both
read this state; neither owns it. A node whose lease expired rejoins as a new member under a new id.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import psutil

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..etcd.lease import KeptLease
from ..etcd.ops import Compare, Op
from ..obs.events import EventLog
from ..planner.interface import NodeState
from ..proc import pid_alive
from ..wire.records import NodeRecord, RecordError, RoundRecord, dumps
from .bootstrap import default_local_addr, pick_master_port
from .settings import RendezvousSettings

log = logging.getLogger(__name__)


def new_node_id(host: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:64].strip("-._") or "node"
    return f"{safe}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class NodeIdInUse(ValueError):
    """Another live process on this host holds this node id in the run."""

    def __init__(self, run_id: str, node_id: str, holder: NodeRecord) -> None:
        super().__init__(
            f"node id {node_id!r} is in use in run {run_id}: pid {holder.pid} on {holder.host} holds it. "
            f"Stop that process first (erm stop {run_id} --node {node_id}), or give this one another "
            "--node-id"
        )


class NodeSession:
    """Identity, lease and registration of one node. ``joined`` is the last round this node joined."""

    def __init__(self, client: EtcdClient, settings: RendezvousSettings):
        self._client = client
        self.settings = settings
        self._keys = settings.keys
        self.host = socket.gethostname()
        self._mem_total = int(psutil.virtual_memory().total)
        self.gpus: tuple[int, str] = (0, "")  # (count, model) from the agent's monitor (set_hardware)
        self.addr = settings.local_addr or default_local_addr()
        self.node_id = settings.node_id or new_node_id(self.host)
        self.lock = threading.RLock()
        self.lease: KeptLease | None = None
        self._incarnation = 0
        self.joined: RoundRecord | None = None
        # A round sealed before this process first registered was made with an earlier process under the
        # same --node-id: joining it would start workers into a world the peers already left. Its number is
        # advertised instead (NodeRecord.round), so the leader sees a restart and writes a new round.
        self.registered_rev = 0  # etcd revision of this incarnation's first registration
        self.stale_round = 0
        self.master_port = 0  # advertised in every record; MASTER_PORT if this node becomes rank 0
        self.ckpt_endpoint = (0, "")  # the agent's checkpoint server: port and token (none: 0, "")
        self.workers_in_place = False  # the agent's workers use elastic_rm.train.rounds (NodeRecord.in_place)
        self.state: NodeState | None = None  # the state of the last registration made
        # The run's event log in etcd, in this node's name; the agent attaches its --event-log file.
        self.events = EventLog(self._keys.run_id, self.node_id, client=client, keys=self._keys)
        self.released = False  # the handler left the run; nothing more is published
        # called (without the lock) before a node whose lease is gone registers again (peer_probe.py)
        self.rejoin_gate: Callable[[], None] | None = None
        # called on the join path once per round that names this node and is not sealed yet, right after
        # this node's ack (the agent's prepared start, elastic_rm/agent/prepared.py); never raises there
        self.on_forming_round: Callable[[RoundRecord], None] | None = None

    @property
    def lease_lost(self) -> bool:
        return self.lease is not None and self.lease.lost

    def live_lease_id(self) -> int | None:
        """The lease to write under, None while there is none or it is lost."""
        lease = self.lease
        return None if lease is None or lease.lost else lease.id

    def start_lease(self) -> None:
        self.lease = KeptLease(self._client, self.settings.lease_ttl)

    def next_master_port(self, avoid: int) -> None:
        """Pick the port this node offers as the next round's MASTER_PORT, not ``avoid`` (the joined
        round's, which its rank 0 binds now)."""
        for _ in range(5):
            self.master_port = pick_master_port()
            if self.master_port != avoid:
                return

    def record(self, state: NodeState) -> NodeRecord:
        # A port in every record, the active one's too: the leader seals a round of survivors at once
        # with its rank 0's port (leader.py, ``_sealed_at_once``), without an ack to carry one.
        if not self.master_port:
            self.master_port = pick_master_port()
        return NodeRecord(
            node=self.node_id,
            host=self.host,
            addr=self.addr,
            pid=os.getpid(),
            nproc=self.settings.nproc,
            state=state,
            round=self.joined.round if self.joined else self.stale_round,
            cpu_count=os.cpu_count() or 0,
            mem_total_bytes=self._mem_total,
            gpu_count=self.gpus[0],
            gpu_model=self.gpus[1],
            master_port=self.master_port,
            ckpt_port=self.ckpt_endpoint[0],
            ckpt_token=self.ckpt_endpoint[1],
            in_place=self.workers_in_place,
        )

    def ensure_registered(self, state: NodeState, wait: bool = True, retry_lost_lease: int = 1) -> None:
        """(Re)register under a live lease. A node whose lease expired rejoins as a new member.

        ``wait=False`` sends the update without waiting for etcd's answer (a failure is logged; the
        lease keeps the old record meanwhile), for updates that nothing on the join path waits for.
        """
        gate = self.rejoin_gate
        if gate is not None and self.lease_lost:
            gate()
        with self.lock:
            if self.lease_lost:
                self._rejoin_as_new_member()
            if self.lease is None:
                self.start_lease()
            assert self.lease is not None
            key, value = self._keys.node(self.node_id), dumps(self.record(state))
            self.state = state
            if not wait:
                self._client.put_nowait(key, value, lease=self.lease.id)
                return
            try:
                if self.registered_rev:
                    rev = self._client.put(key, value, lease=self.lease.id)
                else:
                    rev = self._first_registration(key, value)
                self.registered_rev = self.registered_rev or rev
            except EtcdError as exc:
                if "lease not found" not in str(exc) or retry_lost_lease <= 0:
                    raise
                # The lease expired before its keeper noticed (a paused or starved process): rejoin
                # as a new member now, as when the keeper reports it.
                self.lease.mark_lost()
                self.ensure_registered(state, wait, retry_lost_lease - 1)

    def _first_registration(self, key: str, value: bytes) -> int:
        """This process's first registration of its node id, in one request when the id is free. A record
        of that id under another lease is an earlier process's. A dead one's (an agent restarted at once
        by a supervisor, before its predecessor's lease expired) is taken over, and the run's rounds
        carry on (docs/guarantees.md). One still running on this host would take the rounds of this
        process and this one its rounds: refused (NodeIdInUse). A holder on another host cannot be told
        alive from dead from here: it is taken over as before. Returns the registration's revision."""
        assert self.lease is not None
        got = self._client.txn([Compare.absent(key)], [Op.put(key, value, self.lease.id)], [Op.get(key)])
        if got.succeeded:
            return got.revision
        held = got.kvs[0] if got.kvs else None
        if held is not None and held.lease != self.lease.id:
            try:
                holder = NodeRecord.parse(key, held.value)
            except RecordError:
                holder = None  # a malformed record is overwritten, as any other
            if (
                holder is not None
                and holder.host == self.host
                and holder.pid != os.getpid()
                and pid_alive(holder.pid)
            ):
                raise NodeIdInUse(self._keys.run_id, self.node_id, holder)
        return self._client.put(key, value, lease=self.lease.id)

    def registration(self, state: NodeState) -> tuple[str, bytes, int] | None:
        """This node's record in ``state`` as a ``(key, value, lease)`` put, for a caller that sends it with
        other writes; None without a live lease (then :meth:`ensure_registered` rejoins)."""
        with self.lock:
            lease = self.lease
            if lease is None or lease.lost:
                return None
            self.state = state
            return self._keys.node(self.node_id), dumps(self.record(state)), lease.id

    def republish(self) -> None:
        """Write this node's record again, in the state of its last registration (a field changed: the
        workers said they keep their processes), without waiting; nothing without a live lease."""
        with self.lock:
            lease = self.lease
            if self.state is None or lease is None or lease.lost or self.released:
                return
            self._client.put_nowait(
                self._keys.node(self.node_id), dumps(self.record(self.state)), lease=lease.id
            )

    def _rejoin_as_new_member(self) -> None:
        self._incarnation += 1
        old = self.node_id
        given = self.settings.node_id
        self.node_id = f"{given}-r{self._incarnation}" if given else new_node_id(self.host)
        self.joined = None
        self.registered_rev, self.stale_round = 0, 0
        self.lease = None
        log.warning("lease of node %s expired; rejoining as %s", old, self.node_id)
        self.events.set_node(self.node_id)
        self.events.emit(
            "node", f"lease of {old} expired; rejoining as {self.node_id}", old=old, new=self.node_id
        )

    def check_lease(self) -> None:
        """Ask etcd whether our lease still lives when it was not refreshed for half its TTL (we may
        have been paused): a stale node must rejoin as a new member, not act on an old round."""
        lease = self.lease
        if lease is not None and time.monotonic() - lease.last_refresh > lease.ttl / 2:
            lease.check()
