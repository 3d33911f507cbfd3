"""A client's connection to its etcd cluster: the aetcd client of the endpoint in use, the failover to
another endpoint, and the process's one I/O loop that every connection's calls run on.

A :class:`Connection` is the seam between :class:`~elastic_rm.etcd.client.EtcdClient` and the machinery
that runs on the loop on its behalf (lease keep-alive streams in keepalive.py, watches in watch.py): the
client hands them its connection, never itself, so they see the channel, the timeout and the failover and
nothing else of the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import aetcd

from . import fork
from .endpoint_probe import PROBE_TIMEOUT_S, best_endpoint
from .gateway import GatewayClient
from .options import TlsOptions
from .tls_client import TlsAetcdClient

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20

_IO_LOOP: asyncio.AbstractEventLoop | None = None
_IO_LOCK = threading.Lock()
_INHERITED: list[asyncio.AbstractEventLoop] = []  # a forked child's parent loops: kept, never finalized


def io_loop() -> asyncio.AbstractEventLoop:
    """One I/O thread per process, shared by every connection in it (each keeps its own channel).

    With a thread and an event loop per client, a process with many clients (the benchmarks simulate many
    nodes in one process) spends its time switching between idle loops. Callbacks on this loop must never
    block.
    """
    global _IO_LOOP
    with _IO_LOCK:
        if _IO_LOOP is None or _IO_LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="etcd-io", daemon=True).start()
            _IO_LOOP = loop
        return _IO_LOOP


def _forget_io_loop_in_child() -> None:
    global _IO_LOOP
    if _IO_LOOP is not None:  # its finalizer would close what the parent's gRPC channels registered on it
        _INHERITED.append(_IO_LOOP)
    _IO_LOOP = None  # the parent's I/O thread does not exist in a forked child


os.register_at_fork(after_in_child=_forget_io_loop_in_child)


class Connection:
    """The endpoint a client talks to and the aetcd client (channel) for it, on the process's I/O loop;
    thread-safe.

    ``current()`` is the channel calls go over now; a caller whose call failed on a channel asks for a
    failover from that channel (:meth:`fail_over_blocking` from a caller's thread, :meth:`fail_over` on
    the loop), and the connection moves to another endpoint once per failed channel.
    """

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        timeout: float,
        tls: TlsOptions,
        user: str | None,
        password: str | None,
    ):
        self.endpoints = endpoints
        self.timeout = timeout
        self.loop = io_loop()
        self.closed = False
        self._tls, self._user, self._password = tls, user, password
        self._index = 0
        self._lock = threading.Lock()
        self._client = self._new_client()

    @property
    def identity(self) -> tuple:
        """Which connections may share a keep-alive stream: same endpoints, credentials and timeout."""
        return (tuple(self.endpoints), self._tls, self._user, self._password, self.timeout)

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._index]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def transport(self) -> str:
        """``grpc``, or ``gateway`` in a process forked while gRPC was up in its parent (fork.py)."""
        return "gateway" if isinstance(self._client, GatewayClient) else "grpc"

    def current(self) -> aetcd.Client:
        """The channel calls go over now (a failover replaces it)."""
        return self._client

    def mark_closed(self) -> None:
        """The client closed: its keep-alives and watches stop using this connection."""
        self.closed = True

    async def close_channel(self) -> None:
        """On the loop: close the current channel."""
        await self._client.close()

    def _new_client(self, index: int | None = None) -> aetcd.Client:
        host, port = self.endpoints[self._index if index is None else index]
        options = {
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1000,
            "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        }
        kind = GatewayClient if fork.gateway_needed() else TlsAetcdClient
        return kind(
            host=f"[{host}]" if ":" in host else host,  # an IPv6 address: gRPC's target is [addr]:port
            port=port,
            username=self._user,
            password=self._password,
            timeout=self.timeout,
            options=options,
            tls=self._tls,
        )

    def fail_over_blocking(self, failed: aetcd.Client) -> None:
        """Switch endpoints (once per failed channel): to the first of the others that answers with a
        leader, else that answers at all (all asked at once, endpoint_probe.py), else to the next one in
        the list. From a caller's thread; a coroutine on the loop awaits :meth:`fail_over` instead."""
        if self._failing(failed):
            self._switch(failed, self._probe_others())

    async def fail_over(self, failed: aetcd.Client) -> None:
        """:meth:`fail_over_blocking` for the keep-alive and the watches, which run on the loop: the probe
        runs on that loop too, so blocking it would hold every etcd call of the process, keep-alives
        included, for the probe's whole deadline (long enough for a lease to expire)."""
        if self._failing(failed):
            chosen = None if fork.gateway_needed() else await best_endpoint(self._probes(), self._probe_s)
            self._switch(failed, chosen)

    def _failing(self, failed: aetcd.Client) -> bool:
        with self._lock:
            return self._client is failed and len(self.endpoints) > 1

    def _switch(self, failed: aetcd.Client, chosen: int | None) -> None:
        """Move to ``chosen`` (else the next endpoint) unless another failover has moved already."""
        with self._lock:
            if self._client is not failed:
                return
            self._index = chosen if chosen is not None else (self._index + 1) % len(self.endpoints)
            self._client = self._new_client()
        asyncio.run_coroutine_threadsafe(failed.close(), self.loop)
        log.warning("etcd: switching to endpoint %s", self.endpoint)

    @property
    def _probe_s(self) -> float:
        return min(PROBE_TIMEOUT_S, self.timeout)

    def _probes(self) -> dict[int, aetcd.Client]:
        return {i: self._new_client(i) for i in range(len(self.endpoints)) if i != self._index}

    def _probe_others(self) -> int | None:
        """The index of the other endpoint to move to (endpoint_probe.best_endpoint); None when none
        answered in PROBE_TIMEOUT_S, or over the JSON gateway (its calls block a thread each: the list
        order then)."""
        if fork.gateway_needed():
            return None
        future = asyncio.run_coroutine_threadsafe(best_endpoint(self._probes(), self._probe_s), self.loop)
        try:
            return future.result(self._probe_s + 2.0)
        except Exception:  # noqa: BLE001 - a probe that fails leaves the list order
            future.cancel()
            return None
