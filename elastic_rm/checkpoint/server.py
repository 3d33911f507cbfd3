"""The agent's checkpoint server: this node's flash-checkpoint memory, over HTTP, for its peers.

Why: a node's shards live in its memory (/dev/shm). Peers on other machines need two things from it:
read the steps it holds (its own and the replicas it keeps for peers) when they restore, and push their
replicas into it when they save, so that losing one node loses nothing that is only in memory.

The parts: store.py (what is served and accepted), http.py (the routes and the bearer token), this
module (bind, serve on one daemon thread, stop) and elastic_rm/agent/ckpt_hooks.py (what the agent does
with it).
Every request needs the server's bearer token (a random one per agent, published with the node's record
in etcd). With TLS (peer_tls.py: the node's etcd certificates) it serves HTTPS and requires a
client certificate of the job's CA. Stdlib only; one daemon thread plus one short-lived thread per
request, each bounded by a socket timeout.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from pathlib import Path

from ..background import HttpThread
from .http import CheckpointHttpServer
from .peer_tls import PeerTls
from .store import MAX_FILE_BYTES, CheckpointStore

log = logging.getLogger(__name__)


class CheckpointServer:
    """Serves `node_dir` (a path, or a callable: the node id may change when it rejoins) read-only, and
    accepts replicas into `node_dir/replicas/<src>/`. ``start()`` binds; ``stop()`` frees the port."""

    def __init__(
        self,
        node_dir: Path | Callable[[], Path],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_file_bytes: int = MAX_FILE_BYTES,
        timeout_s: float = 60.0,
        tls: PeerTls | None = None,
    ) -> None:
        self.store = CheckpointStore(node_dir, max_file_bytes)
        self.host = host
        self.token = token or secrets.token_urlsafe(32)
        self.timeout_s = timeout_s
        self.tls = tls
        self._want_port = port
        self._http: HttpThread | None = None

    @property
    def node_dir(self) -> Path:
        return self.store.node_dir

    @property
    def port(self) -> int:
        assert self._http is not None, "start() the server first"
        return self._http.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> CheckpointServer:
        """Bind and serve; OSError (port in use, an address not of this machine) propagates."""
        if self._http is not None:
            return self
        for src in self.store.recover_replicas():
            log.info("finished the interrupted fold of %s's replica in %s", src, self.node_dir)
        server = CheckpointHttpServer(
            self.host, self._want_port, self.store, self.token, self.timeout_s, self.tls
        )
        self._http = HttpThread(server, "erm-ckpt-server")
        log.info("checkpoint server of %s on %s", self.node_dir, self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.stop(timeout_s)

    def __enter__(self) -> CheckpointServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
