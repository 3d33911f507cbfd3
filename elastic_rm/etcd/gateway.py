"""etcd's JSON gateway as the facade's transport in a process forked while gRPC was up in its parent.

gRPC's asyncio layer does not survive fork() (grpc/grpc#19793), but etcd serves the same API as JSON over
HTTP on its client URL (grpc-gateway: ``/v3/kv/range``, ``/v3/watch``...). :class:`GatewayClient` is
aetcd's client with its gRPC stubs replaced by stubs that post the same protobuf messages in protobuf's
JSON mapping with the standard library's http.client (TLS through ssl, with the same CA and client pair).
The facade above it (timeouts, failover, watch resume and compaction resync, lease keep-alive, error
mapping) runs unchanged. Blocking HTTP runs on a small thread pool; each watch stream on a reader thread
of its own, so a long-lived watch never holds a pool thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aetcd
import aetcd.exceptions as aexc
import grpc
from aetcd import rpc, rtypes
from aetcd.client import _handle_errors
from google.protobuf import json_format

from .options import TlsOptions

POOL_THREADS = 8  # concurrent unary calls per process (one HTTP connection each)
_CODES = {status.value[0]: status for status in grpc.StatusCode}
KV = {
    "Range": ("/v3/kv/range", rpc.RangeResponse),
    "Put": ("/v3/kv/put", rpc.PutResponse),
    "DeleteRange": ("/v3/kv/deleterange", rpc.DeleteRangeResponse),
    "Txn": ("/v3/kv/txn", rpc.TxnResponse),
    "Compact": ("/v3/kv/compaction", rpc.CompactionResponse),
}
LEASE = {
    "LeaseGrant": ("/v3/lease/grant", rpc.LeaseGrantResponse),
    "LeaseRevoke": ("/v3/lease/revoke", rpc.LeaseRevokeResponse),
    "LeaseTimeToLive": ("/v3/lease/timetolive", rpc.LeaseTimeToLiveResponse),
}

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="etcd-http")
        return _POOL


def _forget_pool_in_child() -> None:
    global _POOL
    _POOL = None  # the parent's pool threads do not exist in a forked child


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error gRPC would raise: the facade maps it as it maps gRPC's (failover on UNAVAILABLE...)."""
    return grpc.aio.AioRpcError(code, None, None, details=details)


def _answer_error(obj: Any, status: int) -> grpc.aio.AioRpcError:
    """grpc-gateway's error body: ``{"code", "message"}``, in a stream ``{"grpc_code", "message"}``."""
    obj = obj if isinstance(obj, dict) else {}
    code = obj.get("code", obj.get("grpc_code", 2))
    message = obj.get("message") or obj.get("error") or f"HTTP {status}"
    return _rpc_error(_CODES.get(int(code), grpc.StatusCode.UNKNOWN), str(message))


def _transport_error(exc: Exception) -> grpc.aio.AioRpcError:
    code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, TimeoutError) else grpc.StatusCode.UNAVAILABLE
    return _rpc_error(code, f"{type(exc).__name__}: {exc}")


def _json(message: Any) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _parse(obj: dict, reply_type: type) -> Any:
    return json_format.ParseDict(obj, reply_type(), ignore_unknown_fields=True)


class _Http:
    """POSTs JSON to one etcd endpoint over kept-alive connections (one per concurrent call)."""

    def __init__(self, host: str, port: int, tls: TlsOptions, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.token: str | None = None
        self._ssl = self._context(tls) if tls.enabled else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def _context(tls: TlsOptions) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=tls.ca_cert)
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
        return context

    def open(self) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._ssl)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = self.token
        return headers

    def post(self, path: str, body: dict) -> dict:
        """Blocking; raises AioRpcError. A kept-alive connection the server closed meanwhile is retried
        once on a new one (it failed before etcd read the request)."""
        data = json.dumps(body).encode()
        for attempt in range(2):
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            conn = conn or self.open()
            try:
                conn.request("POST", path, body=data, headers=self.headers())
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                stale = isinstance(
                    exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                )
                if reused and stale and attempt == 0:
                    continue
                raise _transport_error(exc) from exc
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
            try:
                obj = json.loads(payload or b"{}")
            except ValueError as exc:
                raise _rpc_error(grpc.StatusCode.INTERNAL, f"etcd answered {path} with non-JSON") from exc
            if "error" in obj and isinstance(obj["error"], dict):  # a stream's error
                raise _answer_error(obj["error"], resp.status)
            if resp.status != 200:
                raise _answer_error(obj, resp.status)
            return obj.get("result", obj)  # a stream's single answer comes as {"result": ...}
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Stub:
    """A gRPC stub's unary methods, each a POST of the request's JSON."""

    def __init__(self, client: GatewayClient, methods: dict[str, tuple[str, type]]):
        self._client, self._methods = client, methods

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._methods:
            raise AttributeError(f"the etcd JSON gateway transport has no {name}")
        path, reply_type = self._methods[name]

        async def call(request: Any, timeout: float | None = None, metadata: Any = None) -> Any:
            return await self._client.unary(path, request, reply_type)

        return call


class _LeaseStub(_Stub):
    def LeaseKeepAlive(self, requests: Any = None, timeout: float | None = None, metadata: Any = None) -> Any:
        return _KeepAliveCall(self._client, requests)


class _KeepAliveCall:
    """The LeaseKeepAlive stream as keepalive.py and aetcd use it: writes, and a reader that takes the
    answers in order (keepalive.py reads in a task of its own), or iterate over the requests given; each
    refresh is one POST (the gateway's stream of one), sent when its answer is read."""

    def __init__(self, client: GatewayClient, requests: Any):
        self._client, self._requests = client, list(requests or [])
        self._pending: asyncio.Queue = asyncio.Queue()

    async def write(self, request: Any) -> None:
        self._pending.put_nowait(request)

    async def read(self) -> Any:
        request = await self._pending.get()
        return await self._client.unary("/v3/lease/keepalive", request, rpc.LeaseKeepAliveResponse)

    def cancel(self) -> None:
        pass  # nothing stays open between refreshes

    async def __aiter__(self) -> Any:
        for request in self._requests:
            yield await self._client.unary("/v3/lease/keepalive", request, rpc.LeaseKeepAliveResponse)


class _WatchStream:
    """One ``/v3/watch`` stream read by a thread of its own; its answers reach the loop through a queue."""

    def __init__(self, http_: _Http, body: dict, loop: asyncio.AbstractEventLoop):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False
        threading.Thread(target=self._read, args=(http_, body), name="etcd-gw-watch", daemon=True).start()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    def _read(self, http_: _Http, body: dict) -> None:
        try:
            self._conn = conn = http_.open()
            if self._closed:
                return
            conn.request("POST", "/v3/watch", body=json.dumps(body).encode(), headers=http_.headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise _answer_error(json.loads(resp.read() or b"{}"), resp.status)
            first = True
            while not self._closed:
                line = resp.readline()
                if not line:
                    raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "etcd closed the watch stream")
                obj = json.loads(line)
                if "error" in obj:
                    raise _answer_error(obj["error"], resp.status)
                self._put(_parse(obj.get("result", {}), rpc.WatchResponse))
                if first and conn.sock is not None:
                    conn.sock.settimeout(None)  # created: from now on a quiet watch is no error
                first = False
        except grpc.aio.AioRpcError as exc:
            self._put(exc)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._put(_transport_error(exc) if not self._closed else exc)
        finally:
            if self._conn is not None:
                self._conn.close()
            # Always a last item: a close() between two lines (a failover closing the client) ended the
            # loop above without one, and the watch then waited on next() forever. Nothing reads past the
            # first error, so one more after an error is harmless.
            self._put(_rpc_error(grpc.StatusCode.UNAVAILABLE, "the watch stream was closed"))

    async def next(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            aexc._handle_exception(item)  # raises aetcd's error, as aetcd's own watch does
        if isinstance(item, BaseException):
            raise aexc.ConnectionFailedError(str(item)) from item
        return item

    def close(self) -> None:
        """Any thread: ends the stream (the reader thread's blocked read returns)."""
        self._closed = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class GatewayClient(aetcd.Client):
    """aetcd's client over etcd's JSON gateway (same arguments as the facade's gRPC one)."""

    def __init__(self, *args: Any, tls: TlsOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._http = _Http(self._host, self._port, tls or TlsOptions(), float(self._timeout or 5.0))
        self._streams: set[_WatchStream] = set()

    async def unary(self, path: str, request: Any, reply_type: type) -> Any:
        loop = asyncio.get_running_loop()
        obj = await loop.run_in_executor(_pool(), self._http.post, path, _json(request))
        return _parse(obj, reply_type)

    @_handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._username is not None and self._http.token is None:
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            reply = await self.unary("/v3/auth/authenticate", request, rpc.AuthenticateResponse)
            self._http.token = reply.token
        self.kvstub = _Stub(self, KV)
        self.leasestub = _LeaseStub(self, LEASE)
        self._connected.set()

    @_handle_errors
    async def watch(
        self, key: bytes, range_end: bytes | None = None, start_revision: int | None = None, **_: Any
    ) -> rtypes.Watch:
        """Like aetcd's: the events from ``start_revision`` on; RevisionCompactedError when compacted."""
        await self.connect()
        create = rpc.WatchCreateRequest(
            key=key, range_end=range_end or b"", start_revision=start_revision or 0
        )
        stream = _WatchStream(self._http, {"create_request": _json(create)}, asyncio.get_running_loop())
        self._streams.add(stream)
        try:
            first = await stream.next()
            if first.compact_revision:
                raise aexc.RevisionCompactedError(first.compact_revision)
        except BaseException:
            self._end(stream)
            raise

        async def iterator() -> Any:
            response = first
            try:
                while True:
                    if response.compact_revision:
                        raise aexc.RevisionCompactedError(response.compact_revision)
                    if response.canceled:
                        raise aexc.ConnectionFailedError(
                            f"etcd cancelled the watch: {response.cancel_reason}"
                        )
                    for event in response.events:
                        yield rtypes.Event(event.type, event.kv)
                    response = await stream.next()
            finally:
                self._end(stream)

        async def cancel() -> None:
            self._end(stream)

        return rtypes.Watch(iterator, cancel, int(first.watch_id))

    def _end(self, stream: _WatchStream) -> None:
        stream.close()
        self._streams.discard(stream)

    async def close(self) -> None:
        for stream in list(self._streams):
            self._end(stream)
        self._http.close()
        self._connected.clear()
