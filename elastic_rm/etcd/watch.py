"""A prefix watch that survives etcd outages without missing or repeating an event, and survives a
compacted history: when etcd no longer holds the revisions it missed (a long partition while the servers
compacted), it re-reads the prefix at the current revision, hands that state to the consumer as a resync,
and resumes watching from the revision after it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aetcd
import aetcd.exceptions as aexc
from aetcd import rpc

from .errors import EtcdCompactedError, EtcdError
from .types import KeyValue, WatchEvent, key_value

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.2


class PrefixWatch:
    """Runs on the loop of its client's connection (connection.py). Re-creates the etcd watch after a
    failure from ``next_revision``.

    On a compacted ``next_revision``: ``on_resync(kvs, revision)`` gets every key under the prefix as
    read at ``revision`` (the consumer replaces what it holds); without one, the keys written since the
    last delivered revision go to ``on_events`` as puts in revision order (a catch-up that cannot show
    deletions or intermediate values) and ``on_error`` is told so. Either way the watch resumes from
    ``revision + 1``: no event older than the state re-read is delivered after it."""

    def __init__(
        self,
        conn: Connection,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], None],
        on_error: Callable[[EtcdError], None] | None,
        exact: bool = False,
        on_resync: Callable[[list[KeyValue], int], None] | None = None,
    ):
        self._conn = conn
        self._prefix = prefix.encode()
        self._range_end = None if exact else aetcd.utils.prefix_range_end(self._prefix)
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self._on_resync = on_resync
        self._compacted: int | None = None  # etcd's oldest kept revision, while a resync is due
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._started = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self._started.wait(), self._conn.timeout)
        except TimeoutError:
            pass  # etcd is down; the task keeps trying and will replay from next_revision

    def cancel(self) -> None:
        self._cancelled = True
        if self._task is not None and not self._conn.closed:
            self._conn.loop.call_soon_threadsafe(self._task.cancel)

    async def stop(self) -> None:
        """On the loop: cancel the task and wait until it has ended."""
        self._cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._cancelled:
            client = self._conn.current()
            try:
                await client.connect()
                if self._compacted is not None:
                    await self._resync(client, self._compacted)
                watch = await client.watch(
                    self._prefix,
                    range_end=self._range_end,
                    start_revision=self.next_revision,
                )
                self._started.set()
                async for event in watch:
                    kv = key_value(event.kv)
                    self.next_revision = kv.mod_revision + 1
                    kind = "put" if event.kind == aetcd.rtypes.EventKind.PUT else "delete"
                    try:
                        self._on_events([WatchEvent(kind, kv)])
                    except Exception:  # noqa: BLE001 - a consumer bug must not kill the watch
                        log.exception("etcd watch consumer failed on %s", kv.key)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._cancelled or (task is not None and task.cancelling()):
                    return
                # Not our cancellation: gRPC ends a call in flight on a channel that is closed (another
                # call's failover closed it) with CancelledError. Ending here left the watch dead.
                log.debug("etcd watch of %s: its channel was closed under it; resuming", self._prefix)
            except aexc.RevisionCompactedError as exc:
                self._started.set()
                self._compacted = int(exc.compacted_revision)
                continue  # resync at once, on the same connection
            except (aexc.ClientError, OSError) as exc:
                log.debug("etcd watch of %s interrupted (%s); resuming", self._prefix, exc)
                await self._conn.fail_over(client)
            if not self._cancelled:
                await asyncio.sleep(RETRY_DELAY_S)

    async def _resync(self, client: aetcd.Client, compacted: int) -> None:
        """Read the prefix at the current revision, deliver it, and move ``next_revision`` past it."""
        request = rpc.RangeRequest(key=self._prefix, range_end=self._range_end or b"")
        try:
            resp = await client.kvstub.Range(request, timeout=self._conn.timeout, metadata=client.metadata)
        except rpc.AioRpcError as exc:
            aexc._handle_exception(exc)  # raises the matching aetcd error: the loop retries
        kvs = [key_value(raw) for raw in resp.kvs]
        revision = int(resp.header.revision)
        missed_from = self.next_revision
        log.warning(
            "etcd watch of %r: history from revision %d is compacted (etcd keeps %d on); re-read %d keys "
            "at revision %d, resuming from %d",
            self._prefix.decode(),
            missed_from,
            compacted,
            len(kvs),
            revision,
            revision + 1,
        )
        self._compacted = None
        self.next_revision = revision + 1
        try:
            if self._on_resync is not None:
                self._on_resync(kvs, revision)
                return
            newer = sorted(
                (kv for kv in kvs if kv.mod_revision >= missed_from), key=lambda kv: kv.mod_revision
            )
            if newer:
                self._on_events([WatchEvent("put", kv) for kv in newer])
            if self._on_error is not None:
                self._on_error(
                    EtcdCompactedError(
                        f"watch of {self._prefix.decode()!r}: history from revision {missed_from} is "
                        f"compacted; caught up with the keys as of revision {revision} (values overwritten "
                        "or deleted meanwhile are not shown)",
                        compacted,
                    )
                )
        except Exception:  # noqa: BLE001 - a consumer bug must not kill the watch
            log.exception("etcd watch consumer failed on the resync of %s", self._prefix.decode())
