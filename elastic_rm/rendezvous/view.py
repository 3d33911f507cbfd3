"""What one node knows of its run, kept current by etcd watches.

Every node watches three keys (``round``, ``leader``, ``closed``); the leader also watches ``nodes/``
and ``rounds/`` (acks). Reads are local: ``num_nodes_waiting()``, called by the agent ten times a
second, never touches etcd. Writers notify ``cond``; waiters re-check their condition on each change.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..etcd.client import EtcdClient, KeyValue, WatchEvent
from ..etcd.errors import EtcdError
from ..planner.interface import NodeMetrics
from ..wire.keyspace import Keyspace
from ..wire.records import AckRecord, ClosedRecord, NodeRecord, RecordError, RoundRecord

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def parse_round(key: str, raw: bytes) -> RoundRecord:
    """One parse per round value per process: the records are immutable, and a process that holds many
    handlers (the scale benchmark's simulated nodes) gets the same value once per handler (a large round's
    value is tens of KB)."""
    return RoundRecord.parse(key, raw)


@dataclass(frozen=True)
class NodeEntry:
    record: NodeRecord
    arrival: int  # create revision of the node key
    seen_at: float  # monotonic time this process first saw it


class JobView:
    """This node's copy of its run's shared state; etcd is the authority, the view follows it.

    State (read it under ``cond``; a single attribute read is fine where a stale value is harmless):

    - ``round``, ``round_rev``: the current round record and its key's mod revision (None, 0: no round).
    - ``leader``, ``leader_rev``: the leading node's id and the create revision of the ``leader`` key
      (the election's fence); ``leader_event_rev``: the revision of the last change the watch delivered.
    - ``closed``: the run's closed record once written; this node never clears it.
    - ``error``: a malformed ``round``/``closed`` value, fatal for the rendezvous until a valid round
      replaces it; ``watch_error``: the last error a watch reported.
    - ``nodes``, ``acks``, ``metrics``: followed only after :meth:`track_members` (the leader).
    - ``version`` is bumped on every change; ``membership_version`` when nodes, the round, the leader or
      closed change (not acks or metrics); ``metrics_version`` on each new metrics record.

    Transitions: the etcd watches apply every change and are the only writers of ``nodes``, ``acks`` and
    ``metrics``. This node's own successful writes may be applied ahead of the watch, through these
    methods only (code outside the class never assigns a field):

    - :meth:`set_round`: our fenced write of ``round`` (ignored when the view saw a later revision);
    - :meth:`note_leadership`: our won election (ignored when the watch delivered a later change of the
      ``leader`` key, e.g. its deletion with an expired lease);
    - :meth:`note_closed`: our write of ``closed`` (an earlier closed record is kept).

    Every transition notifies ``cond``; :meth:`wait` blocks until the next one, :meth:`wake_waiters` wakes
    the waiters without a change (a thread that stops).
    """

    def __init__(
        self,
        client: EtcdClient,
        keys: Keyspace,
        metrics_parser: Callable[[str, bytes], NodeMetrics] | None = None,
    ):
        self._client = client
        self.keys = keys
        self.cond = threading.Condition()
        self.version = 0  # bumped on every change
        self.membership_version = 0  # bumped when nodes, the round, the leader or closed change (not acks)
        self.metrics_version = 0  # bumped on every new metrics record
        self.round: RoundRecord | None = None
        self.round_rev = 0  # mod revision of the round key (0: absent)
        self.leader: str | None = None
        self.leader_rev = 0  # create revision of the leader key
        self.leader_event_rev = 0  # revision of the last change of the leader key the watch delivered
        self.closed: ClosedRecord | None = None
        self.error: RecordError | None = None  # a malformed round/closed value: fatal for the rendezvous
        self.watch_error: EtcdError | None = None
        self.nodes: dict[str, NodeEntry] = {}
        self.acks: dict[int, dict[str, AckRecord]] = {}
        self.metrics: dict[str, NodeMetrics] = {}  # latest record per node (leader only)
        self._metrics_parser = metrics_parser
        self.tracking = False
        self._tracked: set[str] = set()  # prefixes followed so far (track_members)
        self._cancels: list[Callable[[], None]] = []

    # -- set-up ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Read round/leader/closed and watch them from the revision they were read at."""
        kvs, rev = self._client.get_prefix(self.keys.run)
        with self.cond:
            for kv in kvs:
                if kv.key in (self.keys.round, self.keys.leader, self.keys.closed):
                    self._apply(WatchEvent("put", kv))
            self._changed()
        for key in (self.keys.round, self.keys.leader, self.keys.closed):
            self._cancels.append(
                self._client.watch_prefix(
                    key,
                    rev + 1,
                    self._on_events,
                    self._on_error,
                    exact=True,
                    on_resync=self._resync_of(key, True),
                )
            )

    def track_members(self) -> None:
        """Also follow nodes and acks (the leader needs them). Idempotent; a call that failed part way
        (etcd unreachable) is completed by the next one."""
        if self.tracking:
            return
        prefixes = [self.keys.nodes, self.keys.rounds]
        if self._metrics_parser is not None:
            prefixes.append(self.keys.metrics)
        for prefix in prefixes:
            if prefix in self._tracked:
                continue
            kvs, rev = self._client.get_prefix(prefix)
            with self.cond:
                for kv in kvs:
                    self._apply(WatchEvent("put", kv))
                self._changed()
            self._cancels.append(
                self._client.watch_prefix(
                    prefix, rev + 1, self._on_events, self._on_error, on_resync=self._resync_of(prefix)
                )
            )
            self._tracked.add(prefix)
        self.tracking = True

    def stop(self) -> None:
        for cancel in self._cancels:
            cancel()
        self._cancels.clear()

    # -- updates --------------------------------------------------------------------------------------

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self.cond:
            for event in events:
                self._apply(event)
            self._changed()

    def _on_error(self, error: EtcdError) -> None:
        with self.cond:
            self.watch_error = error
            self._changed()

    def _resync_of(self, prefix: str, exact: bool = False) -> Callable[[list[KeyValue], int], None]:
        return lambda kvs, revision: self._on_resync(prefix, exact, kvs, revision)

    def _on_resync(self, prefix: str, exact: bool, kvs: list[KeyValue], revision: int) -> None:
        """The watch of ``prefix`` missed compacted history: ``kvs`` is all of it at ``revision``. What the
        view holds under it and etcd no longer has is deleted, the rest replaced; a key the view already
        knows at a later revision (its own round write, applied ahead of the watch) is kept."""
        present = {kv.key for kv in kvs}
        with self.cond:
            held = self._held_keys(prefix, exact)
            for key in sorted(held - present):
                if key == self.keys.round and self.round_rev > revision:
                    continue  # our own newer write: the watch delivers it next
                self._apply(WatchEvent("delete", KeyValue(key, b"", 0, revision, 0, 0)))
            for kv in kvs:
                if kv.key == self.keys.round and kv.mod_revision < self.round_rev:
                    continue
                self._apply(WatchEvent("put", kv))
            self._changed()
        log.warning(
            "rendezvous view: %s re-read at etcd revision %d after a compacted watch", prefix, revision
        )

    def _held_keys(self, prefix: str, exact: bool) -> set[str]:
        """The keys under ``prefix`` (or the key itself) that the view holds a value of."""
        keys = self.keys
        singles = {keys.round: self.round, keys.leader: self.leader, keys.closed: self.closed}
        held = {k for k, v in singles.items() if v is not None}
        held |= {keys.node(n) for n in self.nodes}
        held |= {keys.ack(r, n) for r, acks in self.acks.items() for n in acks}
        if self._metrics_parser is not None:
            held |= {keys.metric(n) for n in self.metrics}
        return {k for k in held if k == prefix or (not exact and k.startswith(prefix))}

    def _apply(self, event: WatchEvent) -> None:
        kv, keys = event.kv, self.keys
        deleted = event.kind == "delete"
        if "/acks/" not in kv.key and not kv.key.startswith(keys.metrics):
            self.membership_version += 1
        try:
            if kv.key == keys.round:
                self.round = None if deleted else parse_round(kv.key, kv.value)
                self.round_rev = 0 if deleted else kv.mod_revision
                self.error = None
            elif kv.key == keys.leader:
                self.leader = None if deleted else kv.value.decode(errors="replace")
                self.leader_rev = 0 if deleted else kv.create_revision
                self.leader_event_rev = max(self.leader_event_rev, kv.mod_revision)
            elif kv.key == keys.closed:
                self.closed = None if deleted else ClosedRecord.parse(kv.key, kv.value)
            elif kv.key.startswith(keys.nodes):
                self._apply_node(kv, deleted)
            elif kv.key.startswith(keys.rounds) and "/acks/" in kv.key:
                self._apply_ack(kv, deleted)
            elif kv.key.startswith(keys.metrics) and self._metrics_parser is not None:
                self._apply_metrics(kv, deleted)
        except RecordError as exc:
            if kv.key in (keys.round, keys.closed):
                self.error = exc
            log.error("%s", exc)

    def _apply_node(self, kv: KeyValue, deleted: bool) -> None:
        node_id = self.keys.node_of(kv.key)
        if deleted:
            self.nodes.pop(node_id, None)
            return
        record = NodeRecord.parse(kv.key, kv.value)
        if record.node != node_id:
            raise RecordError(f"malformed value in etcd key {kv.key}: it names node {record.node!r}")
        old = self.nodes.get(node_id)
        seen_at = old.seen_at if old else time.monotonic()
        self.nodes[node_id] = NodeEntry(record, kv.create_revision, seen_at)

    def _apply_metrics(self, kv: KeyValue, deleted: bool) -> None:
        node_id = self.keys.node_of(kv.key)
        if deleted:
            self.metrics.pop(node_id, None)
            return
        assert self._metrics_parser is not None
        try:
            self.metrics[node_id] = self._metrics_parser(kv.key, kv.value)
            self.metrics_version += 1
        except ValueError as exc:  # a malformed record: reported, the node keeps its last good one
            log.error("%s", exc)

    def _apply_ack(self, kv: KeyValue, deleted: bool) -> None:
        try:
            number = int(kv.key[len(self.keys.rounds) :].split("/", 1)[0])
        except ValueError:
            raise RecordError(f"malformed etcd key {kv.key}: expected rounds/<number>/acks/<node>") from None
        acks = self.acks.setdefault(number, {})
        node_id = self.keys.node_of(kv.key)
        if deleted:
            acks.pop(node_id, None)
        else:
            acks[node_id] = AckRecord.parse(kv.key, kv.value)
        for old in [n for n in self.acks if n < number - 2]:  # keep only recent rounds in memory
            del self.acks[old]

    def set_round(self, record: RoundRecord, revision: int) -> None:
        """Apply our own successful write at once (the watch confirms it a moment later)."""
        with self.cond:
            if revision > self.round_rev:
                self.round, self.round_rev, self.error = record, revision, None
                self.membership_version += 1
                self._changed()

    def note_leadership(self, node_id: str, revision: int) -> None:
        """Apply our won election at once, unless the watch already saw a later change of the leader key
        (then the view stays as the watch says, and the leader campaigns again)."""
        with self.cond:
            if self.leader_event_rev < revision:
                self.leader, self.leader_rev = node_id, revision
                self.membership_version += 1
                self._changed()

    def note_closed(self, record: ClosedRecord) -> None:
        """Apply our write of ``closed`` at once (the first closed record seen stays)."""
        with self.cond:
            if self.closed is None:
                self.closed = record
                self.membership_version += 1
            self._changed()

    def wake_waiters(self) -> None:
        """Wake every waiter on ``cond`` without a change (a thread that waits in :meth:`wait` stops)."""
        with self.cond:
            self.cond.notify_all()

    def wait(self, seen_version: int, timeout: float) -> int:
        """Block until the view changes after ``seen_version`` or ``timeout`` passes; the new version."""
        with self.cond:
            if self.version == seen_version:
                self.cond.wait(timeout)
            return self.version
