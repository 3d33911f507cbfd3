"""Lease keep-alive: a process's leases share LeaseKeepAlive streams (per etcd cluster and identity).

Why shared streams: etcd's LeaseKeepAlive stream takes requests for any lease ID and answers each with the
ID. With a stream (and a task) per lease, a process of many nodes (the scale benchmark simulates many in
one process) keeps as many streams and channels, each stalling and being reopened on its own, and leases
of live nodes expire. Here the leases of a process share a few streams (:class:`_Hub`, at most
LEASES_PER_STREAM leases each), each lease refreshed on a fixed schedule from its previous send (a late
answer does not push the next refresh back: etcd renews a lease when the request arrives). An answer with
TTL <= 0 reports that one lease lost; the others go on. A stream runs on the channel of one of the
connections (connection.py) whose leases it carries: no extra connection, and nothing of the clients but
their connections is seen here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from aetcd import rpc

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.2  # after a broken stream, before opening a new one
SINGLE_ENDPOINT_SILENCE = 3  # answer timeouts of silence before a lone endpoint's stream is reopened
# Streams reopened in this process, by why (read by the scale benchmark: a reopen costs a refresh's delay).
REOPENS = {"no_answer": 0, "failed": 0}
STREAMS = {"opened": 0}  # keep-alive streams opened in this process (tests: one for many leases)
# etcd answers a stream's requests one after another, and on its leader each renewal first waits until
# the writes committed so far are applied: under a burst of writes (many nodes joining at once) a long
# stream answers its last leases seconds late, past their TTL, and they all expire together. So a stream
# carries at most this many leases.
LEASES_PER_STREAM = 8
# A lease due within this share of its interval is refreshed with the one due now (_Hub._send_due).
BATCH_AHEAD = 0.5


class KeepAlive:
    """Refreshes ``lease_id`` every ``interval`` seconds until stopped or etcd says the lease is gone.

    ``on_refreshed(monotonic_time)`` after each confirmation, ``on_lost()`` once when a refresh answers
    TTL <= 0; both run on the I/O loop and must not block. A broken stream (etcd restarting, a failover)
    is reopened after RETRY_DELAY_S, without counting the lease lost. The refreshes go over the process's
    shared stream for ``conn``'s cluster and identity; they end when ``conn``'s client closes."""

    def __init__(
        self,
        conn: Connection,
        lease_id: int,
        interval: float,
        on_refreshed: Callable[[float], None],
        on_lost: Callable[[], None],
    ):
        self.owner = conn
        self.id = lease_id
        self.interval = interval
        self.on_refreshed = on_refreshed
        self.on_lost = on_lost
        self.next_at = time.monotonic() + interval
        self.stopped = False
        self._hub: _Hub | None = None

    def start(self) -> None:
        if not self.stopped:
            self._hub = _hub_add(self)

    def stop(self) -> None:
        self.stopped = True
        if self._hub is not None:
            _hub_remove(self._hub, self)


# -- the process's shared streams ------------------------------------------------------------------------

_HUBS: dict[tuple, list[_Hub]] = {}  # per identity, streams of at most LEASES_PER_STREAM leases
_HUBS_LOCK = threading.Lock()


def _identity(conn: Connection) -> tuple:
    """Which clients may share a stream: same process, endpoints, credentials and timeout."""
    return (os.getpid(), *conn.identity)


def _hub_add(keeper: KeepAlive) -> _Hub:
    key = _identity(keeper.owner)
    with _HUBS_LOCK:
        hubs = _HUBS.setdefault(key, [])
        hub = min(hubs, key=_Hub.size, default=None)
        if hub is None or hub.size() >= LEASES_PER_STREAM:
            hub = _Hub(key, keeper.owner)
            hubs.append(hub)
        hub.add(keeper)
    return hub


def _hub_remove(hub: _Hub, keeper: KeepAlive) -> None:
    with _HUBS_LOCK:
        if not hub.remove(keeper):
            return
        hubs = _HUBS.get(hub.key, [])
        if hub in hubs:
            hubs.remove(hub)
        if not hubs:
            _HUBS.pop(hub.key, None)
    hub.close()


def drop_owner(conn: Connection) -> None:
    """``conn``'s client closes: stop refreshing the leases it started (the lease is that client's)."""
    with _HUBS_LOCK:
        hubs = list(_HUBS.get(_identity(conn), []))
    for hub in hubs:
        for keeper in hub.keepers_of(conn):
            keeper.stop()


class _Hub:
    """One LeaseKeepAlive stream carrying every lease of its key's clients. The stream runs on the
    channel of one of those clients' connections (the carrier, already connected: it granted a lease);
    when the carrier's client closes, the stream reopens on another's."""

    def __init__(self, key: tuple, like: Connection):
        self.key = key
        self._keepers: dict[int, KeepAlive] = {}
        self._lock = threading.Lock()
        self._loop = like.loop
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._loop.call_soon_threadsafe(self._create)

    def _create(self) -> None:
        if not self._closed:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, keeper: KeepAlive) -> None:
        with self._lock:
            self._keepers[keeper.id] = keeper
        self._loop.call_soon_threadsafe(self._poke)

    def remove(self, keeper: KeepAlive) -> bool:
        """Whether that was the last lease (then the caller closes the hub)."""
        with self._lock:
            if self._keepers.get(keeper.id) is keeper:
                del self._keepers[keeper.id]
            return not self._keepers

    def size(self) -> int:
        return len(self._keepers)

    def keepers_of(self, conn: Connection) -> list[KeepAlive]:
        with self._lock:
            return [k for k in self._keepers.values() if k.owner is conn]

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def close(self) -> None:
        """End the stream (its last lease stopped)."""
        self._closed = True

        def cancel() -> None:
            if self._task is not None:
                self._task.cancel()

        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(cancel)

    def _carrier(self) -> Connection | None:
        """The open connection whose channel carries the stream: the owner of the oldest lease."""
        for keeper in self._snapshot():
            if not keeper.owner.closed:
                return keeper.owner
        return None

    def _snapshot(self) -> list[KeepAlive]:
        with self._lock:
            return list(self._keepers.values())

    def _timeouts(self, carrier: Connection) -> tuple[float, float]:
        """(seconds to wait for a connect or a write, seconds of silence before the stream is reopened)."""
        # an answer later than one refresh interval: the endpoint is cut off or stalled (a silent partition
        # sends no reset), so try the next endpoint rather than wait out the client's timeout past the TTL
        interval = min((k.interval for k in self._snapshot()), default=1.0)
        answer_s = min(carrier.timeout, max(interval, 0.5))
        # With one endpoint there is nothing to fail over to, and a late answer is more often this process's
        # own stall than etcd's: the stream is reopened only after a longer silence.
        silence_s = answer_s if len(carrier.endpoints) > 1 else SINGLE_ENDPOINT_SILENCE * answer_s
        return answer_s, silence_s

    async def _run(self) -> None:
        while not self._closed:
            carrier = self._carrier()
            if carrier is None:  # no lease yet (its add is on the way), or every lease's client closed
                assert self._wake is not None
                self._wake.clear()
                if self._carrier() is None:
                    await self._wake.wait()
                continue
            answer_s, silence_s = self._timeouts(carrier)
            client = carrier.current()
            call = reader = None
            try:
                await asyncio.wait_for(client.connect(), answer_s)
                call = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
                STREAMS["opened"] += 1
                sent: deque[float] = deque()  # when each unanswered request was sent, in order
                reader = asyncio.ensure_future(self._read(call, sent))
                while not self._closed:
                    await self._send_due(call, sent, answer_s)
                    if reader.done():
                        reader.result()  # the stream's error
                        raise ConnectionError("etcd ended the keep-alive stream")
                    if sent and time.monotonic() - sent[0] > silence_s:
                        await asyncio.sleep(0.01)  # answers that arrived while this process was stalled
                        if sent and time.monotonic() - sent[0] > silence_s:
                            raise TimeoutError
                    await self._sleep_until_due(reader)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    return  # closed, or the loop shutting down
                # the call was cancelled under us: a failover or its client's close ended its channel; reopen
                log.debug("keep-alive stream closed with its channel; reopening")
            except grpc.aio.AioRpcError as exc:
                REOPENS["failed"] += 1
                log.debug("keep-alive stream failed (%s); reopening", exc.code())
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    await carrier.fail_over(client)
            except TimeoutError:
                REOPENS["no_answer"] += 1
                log.debug("keep-alive: no answer within %.1fs; trying the next endpoint", silence_s)
                await carrier.fail_over(client)
            except (ConnectionError, OSError, grpc.aio.UsageError) as exc:
                log.debug("keep-alive stream failed (%s); reopening", exc)
            except Exception as exc:  # noqa: BLE001 - aetcd's connect errors: keep trying, as in an outage
                log.debug("keep-alive failed (%r); retrying", exc)
            finally:
                if reader is not None:
                    reader.cancel()
                if call is not None:
                    call.cancel()
            if self._closed:
                return
            try:
                await asyncio.sleep(RETRY_DELAY_S)
            except asyncio.CancelledError:
                return
            now = time.monotonic()
            for keeper in self._snapshot():  # a broken stream: refresh each as soon as the new one is open
                keeper.next_at = min(keeper.next_at, now)

    async def _send_due(self, call: grpc.aio.StreamStreamCall, sent: deque[float], answer_s: float) -> None:
        """One request for every lease whose refresh is due, or due within BATCH_AHEAD of its interval;
        requests go out on schedule whether or not earlier answers were read. Taking the nearly due along
        (a refresh a little early is always safe) brings a stream's leases onto one schedule: one wake-up
        and one write timeout per interval for all of them, instead of one per lease (wake-ups are most of
        the keep-alive's CPU, and the keep-alive most of a waiting node's)."""
        now = time.monotonic()
        due = []
        for keeper in self._snapshot():
            if keeper.stopped or keeper.owner.closed:
                keeper.stop()  # its client closed: the lease is that client's to keep
                continue
            if keeper.next_at > now + keeper.interval * BATCH_AHEAD:
                continue
            keeper.next_at = now + keeper.interval
            due.append(keeper.id)
        if not due:
            return
        async with asyncio.timeout(answer_s):
            for lease_id in due:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                sent.append(time.monotonic())

    async def _sleep_until_due(self, reader: asyncio.Future) -> None:
        keepers = self._snapshot()
        due = min((k.next_at for k in keepers), default=time.monotonic() + 1.0)
        assert self._wake is not None
        self._wake.clear()
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({reader, waker}, timeout=max(0.0, due - time.monotonic()))
        finally:
            waker.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall, sent: deque[float]) -> None:
        """Every answer on the stream: a refresh confirmed, or that one lease gone (then it stops)."""
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("etcd closed the keep-alive stream")
            if sent:
                sent.popleft()
            with self._lock:
                keeper = self._keepers.get(int(reply.ID))
            if keeper is None or keeper.stopped:
                continue
            if reply.TTL <= 0:
                keeper.stop()  # this lease alone; the stream goes on for the others
                keeper.on_lost()
                continue
            keeper.on_refreshed(time.monotonic())
