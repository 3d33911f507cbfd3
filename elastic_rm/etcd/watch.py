"""A prefix watch that survives etcd outages without missing or repeating an event."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aetcd
import aetcd.exceptions as aexc

from .errors import EtcdCompactedError, EtcdError
from .types import WatchEvent, key_value

if TYPE_CHECKING:
    from .client import EtcdClient

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.2


class PrefixWatch:
    """Runs on the client's loop. Re-creates the etcd watch after a failure from ``next_revision``."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent]], None],
        on_error: Callable[[EtcdError], None] | None,
        exact: bool = False,
    ):
        self._client = client
        self._prefix = prefix.encode()
        self._range_end = None if exact else aetcd.utils.prefix_range_end(self._prefix)
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self._task: asyncio.Task | None = None
        self._cancelled = False
        self._started = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self._started.wait(), self._client.timeout)
        except TimeoutError:
            pass  # etcd is down; the task keeps trying and will replay from next_revision

    def cancel(self) -> None:
        self._cancelled = True
        if self._task is not None and not self._client._closed:
            self._client._loop.call_soon_threadsafe(self._task.cancel)

    async def _run(self) -> None:
        while not self._cancelled:
            client = self._client._client
            try:
                await client.connect()
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
                return
            except aexc.RevisionCompactedError as exc:
                self._started.set()
                err = EtcdCompactedError(
                    f"watch of {self._prefix.decode()!r} from revision {self.next_revision} is compacted "
                    f"(oldest kept: {exc.compacted_revision}); re-read the state",
                    exc.compacted_revision,
                )
                if self._on_error is not None:
                    self._on_error(err)
                return
            except (aexc.ClientError, OSError) as exc:
                log.debug("etcd watch of %s interrupted (%s); resuming", self._prefix, exc)
                self._client._failover(client)
            if not self._cancelled:
                await asyncio.sleep(RETRY_DELAY_S)
