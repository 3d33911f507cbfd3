"""The agent's HTTP endpoint: ``/healthz`` (JSON, 200 or 503) and Prometheus ``/metrics``.

Off unless a port is given (0 or None = off). Binds 127.0.0.1 by default: expose it on purpose
(``host="0.0.0.0"``) when a Prometheus server on another machine scrapes it. Runs on one daemon thread
(plus a short-lived thread per request, each bounded by a socket timeout), started and stopped by
:class:`elastic_rm.background.HttpThread`.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from elastic_rm.obs.metrics import CONTENT_TYPE_LATEST, AgentMetrics

from ..background import HttpThread
from ..etcd.server import url_host

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


class EndpointError(RuntimeError):
    """The endpoint could not start (port in use, bad host); the message says which port and what to do."""


class AgentHttpServer:
    """``start()`` binds and serves; ``stop()`` shuts down and frees the port (bounded waits)."""

    def __init__(
        self,
        metrics: AgentMetrics,
        port: int | None,
        host: str = "127.0.0.1",
        health: HealthFn | None = None,
    ) -> None:
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise ValueError(f"metrics port must be an integer in 0..65535 (0 = off), got {port!r}")
        self.metrics = metrics
        self.port = port or None
        self.host = host.strip("[]") if host.startswith("[") else host  # [::1], as in a URL
        self._health = health
        self._http: HttpThread | None = None

    @property
    def enabled(self) -> bool:
        return self.port is not None

    @property
    def url(self) -> str | None:
        return f"http://{url_host(self.host)}:{self.port}" if self._http is not None else None

    @property
    def address(self) -> tuple[str, int] | None:
        """The address the endpoint is bound to while it serves."""
        return None if self._http is None else self._http.server.server_address[:2]

    def health(self) -> tuple[bool, dict[str, Any]]:
        if self._health is not None:
            return self._health()
        return True, {"status": "ok", "node": self.metrics.node, "state": self.metrics.current_state}

    def start(self) -> AgentHttpServer:
        if not self.enabled or self._http is not None:
            return self
        try:
            server = _MetricsHttpServer((self.host, self.port), self)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise EndpointError(
                    f"metrics port {self.port} on {self.host} is already in use; choose a free port or 0 to "
                    "turn the endpoint off"
                ) from None
            raise EndpointError(f"cannot serve metrics on {self.host}:{self.port}: {exc}") from None
        self._http = HttpThread(server, "elastic-rm-http")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.stop(timeout_s)

    def __enter__(self) -> AgentHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _MetricsHttpServer(ThreadingHTTPServer):
    """The endpoint's server: its request handler reads the owner from it."""

    def __init__(self, address: tuple[str, int | None], owner: AgentHttpServer) -> None:
        self.owner = owner
        # the host's own family: an IPv6 address (``::``, ``::1``) or a name with only IPv6 addresses
        # failed with "Address family for hostname not supported" on the default AF_INET socket
        host = address[0] or None  # "": every IPv4 interface, as before
        families = {
            i[0] for i in socket.getaddrinfo(host, address[1], 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        }
        self.address_family = socket.AF_INET if socket.AF_INET in families else socket.AF_INET6
        super().__init__(address, _MetricsRequestHandler)  # type: ignore[arg-type]


class _MetricsRequestHandler(BaseHTTPRequestHandler):
    """``/metrics`` and ``/healthz``; anything else is 404."""

    server: _MetricsHttpServer
    timeout = 5.0  # a stuck client cannot hold a thread for long

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, owner.metrics.exposition())
            elif path == "/healthz":
                ok, detail = owner.health()
                self._send(200 if ok else 503, "application/json", json.dumps(detail).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: try /healthz or /metrics\n")
        except Exception as exc:  # a broken callback must not take the endpoint down
            log.exception("metrics endpoint failed on %s", path)
            self._send(500, "text/plain; charset=utf-8", f"internal error: {exc}\n".encode())

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        log.debug("http %s", format % args)
