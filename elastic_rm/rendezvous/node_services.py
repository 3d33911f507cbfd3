"""The elastic-rm implementation of :class:`NodeServices`: what the agent publishes to, and reads from, etcd
besides the round protocol (metrics, the sample ledger, checkpoint peers, the run's history record).

Owned by the rendezvous handler (``handler.services``), sharing its etcd client, its node session, its
view of the run and its leader; the handler's round protocol never calls it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from ..checkpoint.peer_tls import PeerTls
from ..etcd.client import EtcdClient
from ..obs.events import EventLog
from ..planner.interface import NodeMetrics
from ..wire.metrics_gate import PublishGate
from ..wire.records import LedgerRecord, NodeRecord, RecordError, RoundRecord
from .history_record import build_history_record
from .leader import RoundLeader
from .session import NodeSession
from .view import JobView

log = logging.getLogger(__name__)


class RendezvousNodeServices:
    """NodeServices over etcd, for one node of one run (see elastic_rm.rendezvous.services)."""

    def __init__(
        self,
        client: EtcdClient,
        session: NodeSession,
        view: JobView,
        leader: RoundLeader,
        release: Callable[[], None],
        job: dict | None = None,
        metrics_parser: Callable[[str, bytes], NodeMetrics] | None = None,
    ):
        """``release`` leaves the run (the handler's); ``job`` and ``metrics_parser`` feed the history
        record (without a job description no history is written)."""
        self._client = client
        self._keys = session.settings.keys
        self._session = session
        self._view = view
        self._leader = leader
        self._release = release
        self._job = job
        self._metrics_parser = metrics_parser
        self._created = time.monotonic()
        self._gate = PublishGate()
        self._metrics_epoch: tuple[int, int] | None = None  # (round, lease) the gate's last record was for

    @property
    def node_id(self) -> str:
        return self._session.node_id

    @property
    def addr(self) -> str:
        return self._session.addr

    @property
    def events(self) -> EventLog:
        return self._session.events

    @property
    def lease_ttl(self) -> float:
        return float(self._session.settings.lease_ttl)

    @property
    def checkpoint_tls(self) -> tuple[PeerTls | None, bool]:
        return self._session.settings.checkpoint_tls()

    @property
    def joined_round(self) -> RoundRecord | None:
        return self._session.joined

    @property
    def pending_round(self) -> RoundRecord | None:
        with self._view.cond:
            return self._view.round

    @property
    def closed_by(self) -> str | None:
        with self._view.cond:
            closed = self._view.closed
        return None if closed is None else closed.by

    @property
    def leading(self) -> bool:
        return self._leader.leading

    def publish_metrics(self, value: bytes) -> None:
        """Write ``metrics/<node>`` under the node's lease; nothing before the first round or after release.

        Only a record that changed beyond the gate's band, or a heartbeat, is written (wire/metrics_gate.py:
        1,000 nodes writing a steady record every second would be 1,000 etcd writes a second). A new round
        or a new lease publishes the next record whatever it holds."""
        session = self._session
        lease = session.lease
        if session.released or lease is None or lease.lost or session.joined is None:
            return
        epoch = (session.joined.round, lease.id)
        if epoch != self._metrics_epoch:
            self._metrics_epoch = epoch
            self._gate.reset()
        try:
            record = json.loads(value)
        except ValueError:
            record = None  # not ours to judge: written as given, the leader reports it
        now = time.monotonic()
        if isinstance(record, dict):
            if not self._gate.due(record, now):
                return
            self._gate.published(record, now)
        self._client.put_nowait(self._keys.metric(session.node_id), value, lease=lease.id)

    def set_hardware(self, gpu_count: int, gpu_model: str) -> None:
        """The node's GPUs as the agent's monitor sees them; every later node record carries them."""
        self._session.gpus = (max(int(gpu_count), 0), str(gpu_model))

    def set_workers_in_place(self) -> None:
        """Said once the workers keep their processes across rounds; this node's record says so at once."""
        if not self._session.workers_in_place:
            self._session.workers_in_place = True
            self._session.republish()

    def set_forming_round_hook(self, hook: Callable[[RoundRecord], None] | None) -> None:
        self._session.on_forming_round = hook

    def node_records(self, nodes: list[str]) -> dict[str, NodeRecord]:
        """The records of ``nodes``: from this node's view where it follows them (the leader), else one
        read of ``nodes/`` (a node without a record, or with a malformed one, is left out)."""
        wanted = set(nodes)
        with self._view.cond:
            if self._view.tracking:
                return {n: e.record for n in wanted if (e := self._view.nodes.get(n)) is not None}
        return {rec.node: rec for rec in self._read_nodes("left out") if rec.node in wanted}

    def _read_nodes(self, what: str) -> list[NodeRecord]:
        """Every node record in etcd (one read); a malformed one is logged with ``what`` became of it."""
        kvs, _ = self._client.get_prefix(self._keys.nodes)
        out = []
        for kv in kvs:
            try:
                out.append(NodeRecord.parse(kv.key, kv.value))
            except RecordError as exc:
                log.error("%s (%s)", exc, what)
        return out

    def set_checkpoint_endpoint(self, port: int, token: str) -> None:
        """Published in this node's record from its next registration on (the agent calls this before
        the first rendezvous)."""
        self._session.ckpt_endpoint = (port, token)

    def checkpoint_peers(self) -> dict[str, tuple[str, int, str]]:
        """Every other alive node that serves checkpoints, members or not (a node just left out of the
        round, a replaced straggler say, still holds its shards), read from their lease-bound records in
        etcd (one read, at each worker start). Empty before this node is in a round (joined, or named by
        the round forming now: a prepared start)."""
        pending = self.pending_round
        if self._session.joined is None and (pending is None or self.node_id not in pending.members):
            return {}
        return {
            rec.node: (rec.addr, rec.ckpt_port, rec.ckpt_token)
            for rec in self._read_nodes("not used as a checkpoint peer")
            if rec.node != self._session.node_id and rec.ckpt_port and rec.ckpt_token
        }

    def publish_ledger(self, record: LedgerRecord) -> bool:
        """Fenced by the leader's election: False when this node does not lead (see LedgerRecord)."""
        return self._leader.publish_ledger(record)

    def record_history(self, status: str = "completed") -> bool:
        """Leave this run's record for the warm start of later runs of the same job (planner stage 1).

        Written by the last round's rank 0 only, and only with a job description. Returns whether it wrote.
        """
        r, job, node_id = self._session.joined, self._job, self._session.node_id
        if not job or not job.get("tables") or r is None or not r.members or r.members[0] != node_id:
            return False
        metrics, cpu_counts = {}, {}
        if self._metrics_parser is not None:
            kvs, _ = self._client.get_prefix(self._keys.metrics)
            for kv in kvs:
                try:
                    metrics[self._keys.node_of(kv.key)] = self._metrics_parser(kv.key, kv.value)
                except ValueError as exc:
                    log.error("%s (left out of the history record)", exc)
        gpu_counts: dict[str, int] = {}
        nodes, _ = self._client.get_prefix(self._keys.nodes)
        for kv in nodes:
            try:
                rec = NodeRecord.parse(kv.key, kv.value)
            except RecordError as exc:
                log.error("%s", exc)
                continue
            cpu_counts[self._keys.node_of(kv.key)] = rec.cpu_count
            gpu_counts[self._keys.node_of(kv.key)] = rec.gpu_count
        record = build_history_record(
            job,
            self._keys.run_id,
            status,
            r,
            metrics,
            cpu_counts,
            time.monotonic() - self._created,
            gpu_counts,
            self._latest_coef(),
        )
        self._client.put(self._keys.history(record["signature"]), json.dumps(record, sort_keys=True))
        log.info(
            "recorded run %s in history/%s for later warm starts", self._keys.run_id, record["signature"]
        )
        return True

    def _latest_coef(self) -> list[float]:
        """The model coefficients of the leader's newest outcome record of this run ([] when none)."""
        kvs, _ = self._client.get_prefix(self._keys.rounds)
        newest: tuple[int, list] = (-1, [])
        for kv in kvs:
            if not kv.key.endswith("/outcome"):
                continue
            try:
                d = json.loads(kv.value)
            except (ValueError, RecursionError):
                continue
            coef = d.get("coef") if isinstance(d, dict) else None
            ok = isinstance(coef, list) and len(coef) == 4
            if ok and all(isinstance(c, int | float) and not isinstance(c, bool) for c in coef):
                if isinstance(d.get("round"), int) and d["round"] > newest[0]:
                    newest = (d["round"], coef)
        return newest[1]

    def peers_all_kept(self) -> bool:
        """Every member of our round is kept in the pending round, or left out of it by a planned decision
        while alive (the leader lists the old members it left out alive in the record's ``extra.alive``:
        the kept ones are the members already, and a round of 1,000 is not sent twice). Only
        then can our workers finish a step (a collective with a lost peer never returns), so only then is
        draining them worth waiting for."""
        return peers_kept(self._view.round, self._session.joined)

    def release(self) -> None:
        self._release()


def peers_kept(pending: RoundRecord | None, done: RoundRecord | None) -> bool:
    """`peers_all_kept` for a pending round and the round our workers run in: every member of `done` is a
    member of `pending` or listed alive in its ``extra.alive``. Only the next round's list counts: a later
    round was decided without looking at `done`'s members."""
    if pending is None or done is None or pending.round <= done.round:
        return False
    alive = pending.extra.get("alive") if pending.round == done.round + 1 else None
    alive_set = {a for a in alive if isinstance(a, str)} if isinstance(alive, list) else set()
    return set(done.members) <= set(pending.members) | alive_set
