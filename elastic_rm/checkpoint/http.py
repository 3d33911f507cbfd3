"""The checkpoint server's HTTP routes: a node's flash-checkpoint memory (a CheckpointStore) for its peers.

    GET  /v1/steps                                  {"v": 1, "node", "steps": [...], "replicas": {src: [...]}}
    GET  /v1/steps/<step>/manifest                  the step's manifest.json (own copy, else a replica's)
    GET  /v1/steps/<step>/files/<name>              a file the manifest lists, streamed (sendfile); one
                                                    `Range: bytes=a-b` gives that span only (206)
    GET  /v1/replicas/<src>/links                   {"links": [{"step", "sha", "kind", "parent", ...}]}: the
                                                    chain fields of the steps held for `src`
    POST /v1/replicas/<src>/<step>/begin            start a replica upload (clears a stale one)
    PUT  /v1/replicas/<src>/<step>/files/<name>     upload one file (Content-Length required; hashed as
                                                    it arrives); with ``?begin=1``, begin first (the
                                                    first file of a push)
    POST /v1/replicas/<src>/<step>/commit?keep=N    body: the manifest. Every file of `src` is checked
                                                    against it (size, checksum); then replicas/<src>/step-N
                                                    is published atomically and the replica steps pruned
                                                    to the newest N and the chains they need. A delta
                                                    step whose chain is not held here: 424.
    POST /v1/replicas/<src>/<step>/fold?keep=N      body: the manifest of `src`'s chain folded into its
                                                    base at `step`. The replica's chain is folded in
                                                    place from the deltas held here (inplace.py); a
                                                    chain not held here: 424; files that do not match
                                                    the manifest once folded: 422 (the chain is dropped).

Every request needs ``Authorization: Bearer <token>``; without it: 401. Steps are integers, node ids and
file names plain names (no separators, no '..', no escapes): nothing can leave the node's directory.
Why its own module: the routes parse and check what arrives; the store (store.py) decides what it
means. The request handler reads its configuration (store, token, timeout) from its server.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import socket
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .peer_tls import PeerTls
from .peers import API, safe_name
from .store import CheckpointStore, Refused

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 64 << 20
_STEP = re.compile(r"^\d{1,12}$")
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{1,15})$")
# ASCII digits only: str.isdigit() also takes '²' (which int() refuses: a 500 instead of a 4xx)
_DIGITS = re.compile(r"[0-9]+\Z")
_OK = b'{"ok": true}'


class CheckpointHttpServer(ThreadingHTTPServer):
    """Binds (host, port) (IPv6 when the host has a ':') and answers with :class:`CheckpointRequestHandler`
    for `store`, to requests that carry `token`; each request's socket times out after `timeout_s`.
    With `tls`: HTTPS, and a client must present a certificate of the job's CA (peer_tls.py); the
    handshake runs on the request's thread, so a slow or bad client cannot stall the accept loop."""

    request_queue_size = 64

    def __init__(
        self,
        host: str,
        port: int,
        store: CheckpointStore,
        token: str,
        timeout_s: float,
        tls: PeerTls | None = None,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.store = store
        self.expected_auth = f"Bearer {token}".encode()
        self.request_timeout_s = timeout_s
        self.tls_context = tls.server_context() if tls is not None else None
        super().__init__((host, port), CheckpointRequestHandler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.tls_context is None:
            return sock, addr
        return self.tls_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class CheckpointRequestHandler(BaseHTTPRequestHandler):
    """One request: authenticate, route, answer; a refusal is a JSON error with its status."""

    server: CheckpointHttpServer
    server_version = "elastic-rm-ckpt/1"
    # keep-alive: a node pushing a replica at every step sends its requests on one connection; every
    # answer has a Content-Length, and a refusal closes the connection (its body may be unread). Without
    # Nagle: an answer's headers and body are two writes, and on a kept connection the second waited
    # for the client's delayed ACK
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    tls_refused = False

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # a stuck peer cannot hold a thread forever
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError) as e:
                self.tls_refused = True
                log.warning(
                    "checkpoint server: refused %s: TLS handshake failed (%s); peers need a certificate "
                    "signed by the job's CA",
                    self.client_address[0],
                    getattr(e, "reason", None) or e,
                )
        super().setup()

    def handle(self) -> None:
        if self.tls_refused:
            self.close_connection = True
            return
        super().handle()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        try:
            given = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(given, self.server.expected_auth):
                raise Refused(401, "missing or wrong bearer token (the peer list of ELASTIC_RM_CKPT_PEERS)")
            url = urlsplit(self.path)
            parts = url.path.split("/")
            if parts[:2] != ["", API.strip("/")]:
                raise Refused(404, f"unknown path {url.path!r}: the API is under {API}/")
            self._route(method, parts[2:], parse_qs(url.query))
        except Refused as e:
            self._send_error(e.code, str(e))
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:
            # the rest of a cut body must never be read as the next request on this connection
            self.close_connection = True
            log.debug("checkpoint server: %s %s: client went away (%s)", method, self.path, e)
        except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
            log.exception("checkpoint server: %s %s failed", method, self.path)
            self._send_error(500, f"internal error: {e}")

    def _route(self, method: str, p: list[str], query: dict[str, list[str]]) -> None:
        store = self.server.store
        if method == "GET" and p == ["steps"]:
            return self._send_bytes(json.dumps(store.listing()).encode(), "application/json")
        if method == "GET" and len(p) == 3 and p[0] == "steps" and p[2] == "manifest":
            path = store.manifest_path(_step(p[1]))
            return self._send_bytes(path.read_bytes(), "application/json")
        if method == "GET" and len(p) == 4 and p[0] == "steps" and p[2] == "files":
            return self._send_file(store.file_path(_step(p[1]), _name(p[3])))
        if method == "GET" and len(p) == 3 and p[0] == "replicas" and p[2] == "links":
            links = store.replica_links(_name(p[1]))
            return self._send_bytes(json.dumps({"v": 1, "links": links}).encode(), "application/json")
        if len(p) >= 4 and p[0] == "replicas":
            src, step = _name(p[1]), _step(p[2])
            if method == "POST" and p[3:] == ["begin"]:
                store.begin(src, step)
                return self._send_bytes(_OK, "application/json")
            if method == "PUT" and len(p) == 5 and p[3] == "files":
                if query.get("begin") == ["1"]:  # the first file of a push: begin, one request fewer
                    store.begin(src, step)
                store.receive(src, step, _name(p[4]), self._length(store.max_file_bytes), self.rfile)
                return self._send_bytes(_OK, "application/json")
            if method == "POST" and p[3:] == ["commit"]:
                keep = _keep(query)
                store.commit(src, step, self._body(MAX_MANIFEST_BYTES), keep)
                return self._send_bytes(_OK, "application/json")
            if method == "POST" and p[3:] == ["fold"]:
                store.fold(src, step, self._body(MAX_MANIFEST_BYTES), _keep(query))
                return self._send_bytes(_OK, "application/json")
        raise Refused(404, f"no route for {method} {API}/{'/'.join(p)}")

    def _length(self, limit: int) -> int:
        raw = self.headers.get("Content-Length")
        if raw is None or not _DIGITS.match(raw):
            raise Refused(411, "Content-Length required (no chunked uploads)")
        digits = raw.lstrip("0") or "0"
        if len(digits) > 30 or int(digits) > limit:  # int() refuses 4300 digits and more
            raise Refused(413, f"body of {digits[:40]} bytes is over the limit of {limit}")
        return int(digits)

    def _body(self, limit: int) -> bytes:
        n = self._length(limit)
        data = self.rfile.read(n)
        if len(data) != n:
            raise Refused(400, f"got {len(data)} of {n} bytes (connection cut)")
        return data

    def _send_bytes(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_file(self, path: Path) -> None:
        """The whole file, or one ``Range: bytes=a-b`` of it (206): a resharding reader fetches only
        the checksum blocks it reads."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start, count, code = 0, size, 200
            wanted = self.headers.get("Range")
            if wanted is not None:
                m = _RANGE.match(wanted.strip())
                if not m or int(m[1]) > int(m[2]) or int(m[2]) >= size:
                    raise Refused(416, f"range {wanted!r} is not one span 'bytes=a-b' within {size} bytes")
                start, count, code = int(m[1]), int(m[2]) - int(m[1]) + 1, 206
            self.send_response(code)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(count))
            if code == 206:
                self.send_header("Content-Range", f"bytes {start}-{start + count - 1}/{size}")
            self.end_headers()  # written unbuffered: the socket is ours from here
            if count:
                self.connection.sendfile(f, start, count)

    def _send_error(self, code: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        try:
            self.send_response(code)
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        log.debug("checkpoint server: " + format, *args)


def _step(text: str) -> int:
    if not _STEP.match(text):
        raise Refused(400, f"step {text!r} is not a non-negative integer")
    return int(text)


def _name(text: str) -> str:
    if not safe_name(text):
        raise Refused(400, f"{text!r} is not a plain name (letters, digits, '.', '_', '-'; not '.' or '..')")
    return text


def _keep(query: dict[str, list[str]]) -> int:
    raw = query.get("keep", ["2"])[-1]
    if not _DIGITS.match(raw) or len(raw) > 12 or not 1 <= int(raw) <= 1000:
        raise Refused(400, f"keep={raw!r}: an integer from 1 to 1000 expected")
    return int(raw)
