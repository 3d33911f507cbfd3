"""Client options: endpoints and TLS, validated before anything connects."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from .errors import EtcdConfigError


@dataclass(frozen=True)
class TlsOptions:
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    def validate(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise EtcdConfigError(
                "etcd TLS needs both a client certificate and its key: pass both --etcd-cert and --etcd-key, "
                "or neither"
            )
        for what, path in (
            ("CA certificate", self.ca_cert),
            ("client certificate", self.cert),
            ("client key", self.key),
        ):
            if path is not None and not os.path.isfile(path):
                raise EtcdConfigError(f"etcd TLS {what} file {path!r} does not exist or is not a file")

    @property
    def enabled(self) -> bool:
        return any((self.ca_cert, self.cert, self.key))

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as fh:
                return fh.read()

        return grpc.ssl_channel_credentials(read(self.ca_cert), read(self.key), read(self.cert))


def parse_endpoints(endpoints: str | Sequence[str], default_port: int = 2379) -> list[tuple[str, int]]:
    """``"h1:2379,h2:2379"`` or a list of ``host[:port]`` (an ``http(s)://`` scheme is tolerated; an IPv6
    address in brackets, ``[::1]:2379``, is returned without them)."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        bare = item.split("://", 1)[-1].rstrip("/")
        host, sep, port = bare.rpartition(":")
        if not sep or "]" in port:
            host, port = bare, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EtcdConfigError(
                f"malformed etcd endpoint {item!r}: expected host:port, e.g. 127.0.0.1:2379"
            )
        parsed.append((host, int(port)))
    if not parsed:
        raise EtcdConfigError("no etcd endpoint given: pass host:port (comma-separated for several)")
    return parsed
