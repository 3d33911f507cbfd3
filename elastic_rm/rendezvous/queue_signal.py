"""The cluster's queue for the planner's snapshot: ``queue`` (a QueueRecord), read at most once a second.

Who knows whether other jobs wait for the nodes this run grows into is whatever places the run's nodes on
a shared pool: `erm launch --slurm` writes the key from squeue (elastic_rm.launch.slurm_nodes). `erm launch`
over a hostfile (no other run waits for its hosts) and a fixed Slurm allocation write none, so the key is
absent and the snapshot says None (unknown): the planner keeps its rule for nodes past the request as
without a queue (docs/planner.md, "The cluster's queue").
"""

from __future__ import annotations

import logging
import time

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..wire.keyspace import Keyspace
from ..wire.records import QueueRecord, RecordError

log = logging.getLogger(__name__)

# one key read at most once a second: a node given back to a waiting job waits for this read first
READ_EVERY_S = 1.0


class QueueSignal:
    def __init__(self, client: EtcdClient, keys: Keyspace, every_s: float = READ_EVERY_S):
        self._client, self._key, self._every = client, keys.queue, every_s
        self._value: int | None = None
        self._read_at = float("-inf")
        self._warned = ""

    def waiting_nodes(self) -> int | None:
        """The last ``waiting_nodes`` written (None: no record, or a malformed one, which is logged once)."""
        now = time.monotonic()
        if now - self._read_at < self._every:
            return self._value
        self._read_at = now
        try:
            kv = self._client.get(self._key)
            self._value = QueueRecord.parse(self._key, kv.value).waiting_nodes if kv is not None else None
        except RecordError as exc:
            self._value = None
            self._warn(f"{exc}; the planner is told nothing of the queue")
        except EtcdError as exc:  # keep the last value: the leader's own reads report etcd's state
            self._warn(f"cannot read {self._key} ({exc}); keeping {self._value}")
        return self._value

    def _warn(self, message: str) -> None:
        if message != self._warned:
            self._warned = message
            log.warning(message)
