"""A lease kept alive by a background thread, and an election held with it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .client import Compare, EtcdClient, Op
from .errors import EtcdError

log = logging.getLogger(__name__)


class KeptLease:
    """Grants a lease and refreshes it every ``ttl / 3`` seconds until stopped or lost.

    The refreshes go over one LeaseKeepAlive stream kept open on the client's I/O loop (keepalive.py):
    no thread per lease and no new stream per refresh, which is what let a process of many simulated
    nodes, or a starved agent process, fall behind its TTL. The lease counts as lost only when etcd says
    so (a refresh answers TTL <= 0): during an etcd outage we keep trying, because etcd renews every lease
    when it elects a leader again, so the node's keys survive a short outage
    (tests/chaos/test_etcd_outage.py). ``on_lost`` is called once, from the I/O loop: it must not block.
    ``last_refresh`` (monotonic) is when etcd last confirmed the lease; ``max_gap`` the longest time
    between two confirmations (the keep-alive margin is ``ttl - max_gap``).
    """

    def __init__(self, client: EtcdClient, ttl: int, on_lost: Callable[[], None] | None = None):
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 second, got {ttl}")
        self._client = client
        self.id, self.ttl = client.lease_grant(ttl)
        self.lost = False
        self.last_refresh = time.monotonic()
        self.max_gap = 0.0
        self._on_lost = on_lost
        self._keeper = client.keep_alive(self.id, max(self.ttl / 3.0, 0.2), self._refreshed, self._mark_lost)

    def _refreshed(self, now: float) -> None:
        self.max_gap = max(self.max_gap, now - self.last_refresh)
        self.last_refresh = now

    def mark_lost(self) -> None:
        """Record that etcd no longer knows this lease (a write under it said so): stop refreshing it."""
        self._keeper.stop()
        self._mark_lost()

    def _mark_lost(self) -> None:
        if self.lost:
            return
        self.lost = True
        log.warning("etcd lease %x expired: this node's keys are gone", self.id)
        if self._on_lost is not None:
            self._on_lost()

    def check(self) -> bool:
        """Ask etcd now; returns False (and fires on_lost) when the lease is gone."""
        if self.lost:
            return False
        try:
            if self._client.lease_refresh(self.id) <= 0:
                self.mark_lost()
            else:
                self._refreshed(time.monotonic())
        except EtcdError:
            pass
        return not self.lost

    def revoke(self) -> None:
        self._keeper.stop()
        if not self.lost:
            try:
                self._client.lease_revoke(self.id)
            except EtcdError as exc:
                log.debug("lease %x revoke failed: %s", self.id, exc)
        self.lost = True

    def stop(self) -> None:
        """Stop refreshing without revoking (the keys then expire after the TTL)."""
        self._keeper.stop()


class Election:
    """Leadership as a key held by a lease: whoever creates ``key`` leads until its lease ends.

    ``revision`` (the key's create revision) is the fencing token: writes made as leader carry
    :meth:`fence`, so a deposed leader's transaction fails instead of overwriting a newer decision.
    """

    def __init__(self, client: EtcdClient, key: str, value: str, lease_id: int):
        self._client, self.key, self.value, self.lease_id = client, key, value, lease_id
        self.revision: int | None = None

    def try_acquire(self) -> bool:
        result = self._client.txn([Compare.absent(self.key)], [Op.put(self.key, self.value, self.lease_id)])
        self.revision = result.revision if result.succeeded else None
        return result.succeeded

    def fence(self) -> Compare:
        if self.revision is None:
            raise EtcdError(f"not the leader of {self.key}: campaign first")
        return Compare.create(self.key, self.revision)
