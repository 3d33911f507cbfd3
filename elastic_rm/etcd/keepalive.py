"""One lease's keep-alive: a LeaseKeepAlive stream kept open on the client's I/O loop.

Why not a thread that calls refresh: aetcd's ``refresh_lease`` opens a new gRPC stream for every refresh,
and a thread per lease has to be scheduled in time for each one. A process of many nodes (the scale
benchmark's 128 simulated nodes per process) or an agent starved of CPU then refreshed too late and lost
leases while alive. Here a refresh is one message on an open stream, sent from the I/O loop, on a fixed
schedule from the previous send (a late answer does not push the next refresh back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from aetcd import rpc

if TYPE_CHECKING:
    from .client import EtcdClient

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.2  # after a broken stream, before opening a new one
SINGLE_ENDPOINT_SILENCE = 3  # answer timeouts of silence before a lone endpoint's stream is reopened
# Streams reopened in this process, by why (read by the scale benchmark: a reopen costs a refresh's delay).
REOPENS = {"no_answer": 0, "failed": 0}


class KeepAlive:
    """Refreshes ``lease_id`` every ``interval`` seconds until stopped or etcd says the lease is gone.

    ``on_refreshed(monotonic_time)`` after each confirmation, ``on_lost()`` once when a refresh answers
    TTL <= 0; both run on the I/O loop and must not block. A broken stream (etcd restarting, a failover)
    is reopened after RETRY_DELAY_S, without counting the lease lost."""

    def __init__(
        self,
        client: EtcdClient,
        lease_id: int,
        interval: float,
        on_refreshed: Callable[[float], None],
        on_lost: Callable[[], None],
    ):
        self._client = client
        self._id = lease_id
        self._interval = interval
        self._on_refreshed = on_refreshed
        self._on_lost = on_lost
        self._task: asyncio.Task | None = None
        self._stopped = False

    def start(self) -> None:
        def create() -> None:
            if not self._stopped:
                self._task = asyncio.get_running_loop().create_task(self._run())

        self._client._loop.call_soon_threadsafe(create)

    def stop(self) -> None:
        self._stopped = True
        loop = self._client._loop

        def cancel() -> None:
            if self._task is not None:
                self._task.cancel()

        if not loop.is_closed():
            loop.call_soon_threadsafe(cancel)

    async def _run(self) -> None:
        next_at = time.monotonic() + self._interval
        # an answer later than one refresh interval: the endpoint is cut off or stalled (a silent partition
        # sends no reset), so try the next endpoint rather than wait out the client's timeout past the TTL
        answer_s = min(self._client.timeout, max(self._interval, 0.5))
        # With one endpoint there is nothing to fail over to, and a late answer is more often this process's
        # own stall than etcd's: the stream is reopened only after a longer silence.
        silence_s = answer_s if len(self._client.endpoints) > 1 else SINGLE_ENDPOINT_SILENCE * answer_s
        while not self._stopped and not self._client._closed:
            client = self._client._client
            call = reader = None
            try:
                await asyncio.wait_for(client.connect(), answer_s)
                call = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
                sent: deque[float] = deque()  # when each unanswered request was sent
                reader = asyncio.ensure_future(self._read(call, sent))
                while not self._stopped:
                    # requests go out on schedule whether or not the last answer was read: etcd renews the
                    # lease when a request arrives, so a reply read late (a starved process) delays nothing
                    await asyncio.wait({reader}, timeout=max(0.0, next_at - time.monotonic()))
                    if reader.done():
                        reader.result()  # the stream's error, or the lease is gone (then stopped)
                        break
                    next_at = time.monotonic() + self._interval
                    if sent and time.monotonic() - sent[0] > silence_s:
                        await asyncio.sleep(0.01)  # answers that arrived while this process was stalled
                        if sent and time.monotonic() - sent[0] > silence_s:
                            raise TimeoutError
                    await asyncio.wait_for(call.write(rpc.LeaseKeepAliveRequest(ID=self._id)), answer_s)
                    sent.append(time.monotonic())
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopped or (task is not None and task.cancelling()):
                    return  # stop(), or the loop shutting down
                # the call was cancelled under us: a failover closed the channel it ran on; reopen
                log.debug("lease %x keep-alive stream closed with its channel; reopening", self._id)
            except grpc.aio.AioRpcError as exc:
                REOPENS["failed"] += 1
                log.debug("lease %x keep-alive stream failed (%s); reopening", self._id, exc.code())
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._client._failover(client)
            except TimeoutError:
                REOPENS["no_answer"] += 1
                log.debug(
                    "lease %x keep-alive: no answer within %.1fs; trying the next endpoint",
                    self._id,
                    silence_s,
                )
                self._client._failover(client)
            except (ConnectionError, OSError, grpc.aio.UsageError) as exc:
                log.debug("lease %x keep-alive stream failed (%s); reopening", self._id, exc)
            except Exception as exc:  # noqa: BLE001 - aetcd's connect errors; keep trying, as during an outage
                log.debug("lease %x keep-alive failed (%r); retrying", self._id, exc)
            finally:
                if reader is not None:
                    reader.cancel()
                if call is not None:
                    call.cancel()
            if self._stopped:
                return
            try:
                await asyncio.sleep(RETRY_DELAY_S)
            except asyncio.CancelledError:
                return
            next_at = time.monotonic()  # a broken stream: refresh as soon as the new one is open

    async def _read(self, call: grpc.aio.StreamStreamCall, sent: deque[float]) -> None:
        """Every answer on the stream: a refresh confirmed, or the lease gone (then stop)."""
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise ConnectionError("etcd closed the keep-alive stream")
            if sent:
                sent.popleft()
            if reply.TTL <= 0:
                self._stopped = True
                self._on_lost()
                return
            self._on_refreshed(time.monotonic())
