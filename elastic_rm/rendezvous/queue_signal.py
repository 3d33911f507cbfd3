"""The cluster's queue for the planner's snapshot: ``queue`` (a QueueRecord), read at most once a second.

Who knows whether other jobs wait for the nodes this run grows into is whatever places the run's nodes on
a shared pool: `erm launch --slurm` writes the key from squeue (elastic_rm.launch.slurm_nodes). `erm launch`
over a hostfile (no other run waits for its hosts) and a fixed Slurm allocation write none, so the key is
absent and the snapshot says None (unknown): the planner keeps its rule for nodes past the request as
without a queue (docs/planner.md, "The cluster's queue").

The writer rewrites the record (its ``time``) at least every QUEUE_WRITE_EVERY_S (wire/records.py); a
record the leader has seen unchanged for QUEUE_STALE_AFTER_S (its writer is gone: a killed ``erm launch``)
is unknown too, so that a frozen
count neither keeps giving nodes back nor keeps holding growth. The age is measured by the leader's own
clock from when it first read that record, so that a skew between the writer's clock and its own does not
count.

The record's ``running_nodes`` (the run's node jobs that Slurm runs now) holds the run's first round
(leader.py). A record that is missing, malformed, stale, or written more than ``stale_after_s`` ago by the
writer's clock counts 0: a dead launcher's last count must never hold a round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..wire.keyspace import Keyspace
from ..wire.records import QUEUE_STALE_AFTER_S, QUEUE_WRITE_EVERY_S, QueueRecord, RecordError

log = logging.getLogger(__name__)

# one key read at most once a second: a node given back to a waiting job waits for this read first
READ_EVERY_S = 1.0


class QueueSignal:
    def __init__(
        self,
        client: EtcdClient,
        keys: Keyspace,
        every_s: float = READ_EVERY_S,
        stale_after_s: float = QUEUE_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client, self._key, self._every = client, keys.queue, every_s
        self._stale_after, self._clock = stale_after_s, clock
        self._value: QueueRecord | None = None  # the last fresh record (None: unknown)
        self._read_at = float("-inf")
        self._record: QueueRecord | None = None  # the record last read, and when it was first read
        self._seen_at = float("-inf")
        self._warned = ""

    def waiting_nodes(self) -> int | None:
        """The last ``waiting_nodes`` written (None: no record, a malformed one, which is logged once, or a
        stale one: unchanged for ``stale_after_s``, logged once)."""
        record = self._read()
        return record.waiting_nodes if record is not None else None

    def running_nodes(self) -> int:
        """The run's node jobs that its pool runs now, as last written; 0 when unknown or old."""
        record = self._read()
        if record is None or time.time() - record.time > self._stale_after:
            return 0
        return record.running_nodes

    def _read(self) -> QueueRecord | None:
        now = self._clock()
        if now - self._read_at < self._every:
            return self._value
        self._read_at = now
        try:
            kv = self._client.get(self._key)
            self._value = self._fresh(QueueRecord.parse(self._key, kv.value), now) if kv is not None else None
        except RecordError as exc:
            self._value = None
            self._warn(f"{exc}; the planner is told nothing of the queue")
        except EtcdError as exc:  # keep the last value: the leader's own reads report etcd's state
            self._warn(f"cannot read {self._key} ({exc}); keeping the last value read")
        return self._value

    def _fresh(self, record: QueueRecord, now: float) -> QueueRecord | None:
        """The record, or None when it has not changed for ``stale_after_s``."""
        if record != self._record:
            self._record, self._seen_at = record, now
        if now - self._seen_at <= self._stale_after:
            return record
        self._warn(
            f"{self._key} unchanged for more than {self._stale_after:g}s (its writer rewrites it every "
            f"{QUEUE_WRITE_EVERY_S:g}s; is erm launch still running?): the planner is told nothing of the "
            "queue"
        )
        return None

    def _warn(self, message: str) -> None:
        if message != self._warned:
            self._warned = message
            log.warning(message)
