"""The agent's checkpoint server: this node's flash-checkpoint memory, over HTTP, for its peers.

Why: a node's shards live in its memory (/dev/shm). Peers on other machines need two things from it:
read the steps it holds (its own and the replicas it keeps for peers) when they restore, and push their
replicas into it when they save, so that losing one node loses nothing that is only in memory.

    GET  /v1/steps                                  {"v": 1, "node", "steps": [...], "replicas": {src: [...]}}
    GET  /v1/steps/<step>/manifest                  the step's manifest.json (own copy, else a replica's)
    GET  /v1/steps/<step>/files/<name>              a file the manifest lists, streamed (sendfile); one
                                                    `Range: bytes=a-b` gives that span only (206)
    POST /v1/replicas/<src>/<step>/begin            start a replica upload (clears a stale one)
    PUT  /v1/replicas/<src>/<step>/files/<name>     upload one file (Content-Length required; hashed as it arrives)
    POST /v1/replicas/<src>/<step>/commit?keep=N    body: the manifest. Every file of `src` is checked against it
                                                    (size, checksum); then replicas/<src>/step-N is published
                                                    atomically and all but the newest N replica steps pruned.

Every request needs ``Authorization: Bearer <token>`` (a random token per agent, published with the
node's record in etcd); without it: 401. Steps are integers, node ids and file names plain names
(no separators, no '..', no escapes): nothing can leave the node's directory. Uploads are size-limited
and refused when the memory file system lacks the room. Stdlib only; one daemon thread plus one
short-lived thread per request, each bounded by a socket timeout.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from ..train.manifest import (
    FILE_HASH,
    MANIFEST,
    CorruptCheckpointError,
    committed_steps,
    entry_hash,
    file_digest,
    new_hasher,
    parse_manifest,
    prune_steps,
    publish_dir,
    step_dirname,
    write_file,
)
from ..train.paths import run_memory_dir
from ..train.peers import API, PEERS_ENV, PeerEndpoint, encode_peers, safe_name
from .http import serve_in_thread, shut_down

if TYPE_CHECKING:  # the stand-alone server (main) needs no rendezvous
    from ..rendezvous.services import NodeServices

log = logging.getLogger(__name__)

TOKEN_ENV = "ELASTIC_RM_CKPT_TOKEN"  # the CLI's token (never on the command line, where `ps` shows it)
MAX_FILE_BYTES = 256 << 30  # one uploaded checkpoint file
MAX_MANIFEST_BYTES = 64 << 20
FREE_RESERVE_BYTES = 256 << 20  # an upload must leave this much free in the memory file system
_STEP = re.compile(r"^\d{1,12}$")
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{1,15})$")
CHUNK = 4 << 20


class _Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


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
    ) -> None:
        self._node_dir = node_dir if callable(node_dir) else (lambda d=Path(node_dir): d)
        self.host = host
        self.token = token or secrets.token_urlsafe(32)
        self.max_file_bytes = max_file_bytes
        self.timeout_s = timeout_s
        self._want_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # replica upload state and commits
        self._pending: dict[
            tuple[str, int], dict[str, tuple[int, str]]
        ] = {}  # (src, step) -> name -> (size, checksum)

    @property
    def node_dir(self) -> Path:
        return self._node_dir()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the server first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> CheckpointServer:
        """Bind and serve; OSError (port in use, an address not of this machine) propagates."""
        if self._server is not None:
            return self
        server_cls = _Server6 if ":" in self.host else _Server
        server = server_cls((self.host, self._want_port), _make_handler(self))
        self._server = server
        self._thread = serve_in_thread(server, "erm-ckpt-server")
        log.info("checkpoint server of %s on %s", self.node_dir, self.url)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        shut_down(server, thread, timeout_s)

    def __enter__(self) -> CheckpointServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what the routes do ---------------------------------------------------------------------
    def _step_dirs(self, step: int) -> list[Path]:
        """Committed copies of `step` here, own first, then the replicas (sorted by source node)."""
        root = self.node_dir
        dirs = [root / step_dirname(step)]
        rep = root / "replicas"
        if rep.is_dir():
            dirs += sorted(p / step_dirname(step) for p in rep.iterdir() if safe_name(p.name))
        return [d for d in dirs if (d / MANIFEST).is_file()]

    def listing(self) -> dict[str, Any]:
        root = self.node_dir

        def committed(d: Path) -> list[int]:
            return [s for s in committed_steps(d) if (d / step_dirname(s) / MANIFEST).is_file()]

        rep = root / "replicas"
        replicas = {}
        if rep.is_dir():
            replicas = {
                p.name: committed(p) for p in sorted(rep.iterdir()) if safe_name(p.name) and p.is_dir()
            }
        return {"v": 1, "node": root.name, "steps": committed(root), "replicas": replicas}

    def manifest_path(self, step: int) -> Path:
        dirs = self._step_dirs(step)
        if not dirs:
            raise _Refused(404, f"step {step} is not held here")
        return dirs[0] / MANIFEST

    def file_path(self, step: int, name: str) -> Path:
        """The first copy of `name` in a step directory whose manifest lists it."""
        for d in self._step_dirs(step):
            try:
                files = json.loads((d / MANIFEST).read_bytes()).get("files", {})
            except (OSError, ValueError):
                continue
            if isinstance(files, dict) and name in files and (d / name).is_file():
                return d / name
        raise _Refused(404, f"no copy of {name} of step {step} here (not held, or not in its manifest)")

    def _replica_root(self, src: str) -> Path:
        return self.node_dir / "replicas" / src

    def begin(self, src: str, step: int) -> None:
        """A node pushes one step at a time: its unfinished uploads of other steps are dropped."""
        with self._lock:
            for key in [k for k in self._pending if k[0] == src]:
                del self._pending[key]
                shutil.rmtree(self._replica_root(src) / (step_dirname(key[1]) + ".tmp"), ignore_errors=True)
            tmp = self._replica_root(src) / (step_dirname(step) + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._pending[(src, step)] = {}

    def receive(self, src: str, step: int, name: str, length: int, rfile: Any) -> None:
        """Stream `length` bytes into the replica's temp directory, hashing as they arrive."""
        with self._lock:
            if (src, step) not in self._pending:
                raise _Refused(409, f"no upload of step {step} from {src} in progress: POST .../begin first")
        tmp = self._replica_root(src) / (step_dirname(step) + ".tmp")
        if length > self.max_file_bytes:
            raise _Refused(
                413, f"{name}: {length} bytes is over this server's limit of {self.max_file_bytes}"
            )
        free = shutil.disk_usage(tmp).free
        if length + FREE_RESERVE_BYTES > free:
            raise _Refused(507, f"{name}: {length} bytes do not fit in {tmp.parent} ({free} bytes free)")
        h = new_hasher(FILE_HASH)
        part = tmp / (name + ".part")
        got = 0
        try:
            with open(part, "wb") as f:
                while got < length:
                    block = rfile.read(min(CHUNK, length - got))
                    if not block:
                        break
                    h.update(block)
                    f.write(block)
                    got += len(block)
            if got != length:
                raise _Refused(400, f"{name}: got {got} of {length} bytes (connection cut)")
            os.replace(part, tmp / name)
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            pending = self._pending.get((src, step))
            if pending is None:  # a newer begin (or a commit) raced us: this upload is void
                raise _Refused(409, f"the upload of step {step} from {src} was restarted meanwhile")
            pending[name] = (got, h.hexdigest())

    def commit(self, src: str, step: int, body: bytes, keep: int) -> None:
        """Check every uploaded file against the manifest, then publish the replica atomically."""
        root = self._replica_root(src)
        tmp = root / (step_dirname(step) + ".tmp")
        with self._lock:
            pending = self._pending.pop((src, step), None)
            if pending is None:
                raise _Refused(409, f"no upload of step {step} from {src} in progress: POST .../begin first")
            try:
                manifest = parse_manifest(body, f"replica of step {step} from {src}")
                if manifest["step"] != step:
                    raise CorruptCheckpointError(f"the manifest is of step {manifest['step']}, not {step}")
                wanted = {n: e for n, e in manifest["files"].items() if e.get("node") in (src, "*")}
                problems = [f"{n}: missing" for n in sorted(set(wanted) - set(pending))]
                problems += [
                    f"{n}: not a file of {src} in the manifest" for n in sorted(set(pending) - set(wanted))
                ]
                for n in sorted(set(wanted) & set(pending)):
                    size, got = pending[n]
                    alg, expected = entry_hash(wanted[n])
                    if alg != FILE_HASH and size == wanted[n]["size"]:  # a manifest of an older version
                        got = file_digest(tmp / n, alg)
                    if size != wanted[n]["size"] or got != expected:
                        problems.append(
                            f"{n}: size/checksum do not match the manifest (corrupt in transit or at source)"
                        )
                if problems:
                    raise CorruptCheckpointError("; ".join(problems))
            except CorruptCheckpointError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise _Refused(422, f"replica refused: {e}") from None
            write_file(tmp / MANIFEST, body, sync=False)
            publish_dir(tmp, root / step_dirname(step), sync=False)
            prune_steps(root, keep)
        log.info("replica of step %d from %s committed (%d files)", step, src, len(pending))


class _Server(ThreadingHTTPServer):
    request_queue_size = 64


class _Server6(_Server):
    address_family = socket.AF_INET6


def _make_handler(owner: CheckpointServer) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {owner.token}".encode()

    class Handler(BaseHTTPRequestHandler):
        server_version = "elastic-rm-ckpt/1"
        timeout = owner.timeout_s  # a stuck peer cannot hold a thread forever

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._dispatch("GET")

        def do_PUT(self) -> None:  # noqa: N802
            self._dispatch("PUT")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            try:
                given = (self.headers.get("Authorization") or "").encode()
                if not hmac.compare_digest(given, expected):
                    raise _Refused(
                        401, "missing or wrong bearer token (the peer list of ELASTIC_RM_CKPT_PEERS)"
                    )
                url = urlsplit(self.path)
                parts = url.path.split("/")
                if parts[:2] != ["", API.strip("/")]:
                    raise _Refused(404, f"unknown path {url.path!r}: the API is under {API}/")
                self._route(method, parts[2:], parse_qs(url.query))
            except _Refused as e:
                self._send_error(e.code, str(e))
            except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:
                log.debug("checkpoint server: %s %s: client went away (%s)", method, self.path, e)
            except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
                log.exception("checkpoint server: %s %s failed", method, self.path)
                self._send_error(500, f"internal error: {e}")

        def _route(self, method: str, p: list[str], query: dict[str, list[str]]) -> None:
            if method == "GET" and p == ["steps"]:
                return self._send_bytes(json.dumps(owner.listing()).encode(), "application/json")
            if method == "GET" and len(p) == 3 and p[0] == "steps" and p[2] == "manifest":
                path = owner.manifest_path(_step(p[1]))
                return self._send_bytes(path.read_bytes(), "application/json")
            if method == "GET" and len(p) == 4 and p[0] == "steps" and p[2] == "files":
                return self._send_file(owner.file_path(_step(p[1]), _name(p[3])))
            if len(p) >= 4 and p[0] == "replicas":
                src, step = _name(p[1]), _step(p[2])
                if method == "POST" and p[3:] == ["begin"]:
                    owner.begin(src, step)
                    return self._send_bytes(b'{"ok": true}', "application/json")
                if method == "PUT" and len(p) == 5 and p[3] == "files":
                    owner.receive(src, step, _name(p[4]), self._length(owner.max_file_bytes), self.rfile)
                    return self._send_bytes(b'{"ok": true}', "application/json")
                if method == "POST" and p[3:] == ["commit"]:
                    keep = _keep(query)
                    owner.commit(src, step, self._body(MAX_MANIFEST_BYTES), keep)
                    return self._send_bytes(b'{"ok": true}', "application/json")
            raise _Refused(404, f"no route for {method} {API}/{'/'.join(p)}")

        def _length(self, limit: int) -> int:
            raw = self.headers.get("Content-Length")
            if raw is None or not raw.isdigit():
                raise _Refused(411, "Content-Length required (no chunked uploads)")
            n = int(raw)
            if n > limit:
                raise _Refused(413, f"body of {n} bytes is over the limit of {limit}")
            return n

        def _body(self, limit: int) -> bytes:
            n = self._length(limit)
            data = self.rfile.read(n)
            if len(data) != n:
                raise _Refused(400, f"got {len(data)} of {n} bytes (connection cut)")
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
                        raise _Refused(
                            416, f"range {wanted!r} is not one span 'bytes=a-b' within {size} bytes"
                        )
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

    return Handler


def _step(text: str) -> int:
    if not _STEP.match(text):
        raise _Refused(400, f"step {text!r} is not a non-negative integer")
    return int(text)


def _name(text: str) -> str:
    if not safe_name(text):
        raise _Refused(400, f"{text!r} is not a plain name (letters, digits, '.', '_', '-'; not '.' or '..')")
    return text


def _keep(query: dict[str, list[str]]) -> int:
    raw = query.get("keep", ["2"])[-1]
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise _Refused(400, f"keep={raw!r}: an integer from 1 to 1000 expected")
    return int(raw)


# ---- the agent's hooks ---------------------------------------------------------------------------
def start_for_agent(services: NodeServices | None, run_id: str) -> CheckpointServer | None:
    """Start this node's server on the node's address and hand port and token to the node services,
    which publish them in the node's record. None without node services (torch's backends) or when the
    address cannot be bound (a warning: restores then use local memory and the durable copy only)."""
    if services is None or not services.addr:
        return None
    addr = services.addr
    root = run_memory_dir(run_id)
    server = CheckpointServer(lambda: root / services.node_id, host=addr)
    try:
        server.start()
    except OSError as e:
        log.warning(
            "checkpoint server: cannot listen on %s (%s); peers cannot fetch or replicate this node's flash "
            "checkpoints (set --local-addr to an address of this machine)",
            addr,
            e,
        )
        return None
    services.set_checkpoint_endpoint(server.port, server.token)
    return server


def peer_endpoints(services: NodeServices | None) -> list[PeerEndpoint] | None:
    """Every other alive node that serves its checkpoints (one etcd read). None without node services
    (torch's backends)."""
    if services is None:
        return None
    peers = []
    for node, (addr, port, token) in sorted(services.checkpoint_peers().items()):
        host = f"[{addr}]" if ":" in addr else addr
        peers.append(PeerEndpoint(node, f"http://{host}:{port}", token))
    return peers


def peers_env(services: NodeServices | None) -> str | None:
    """ELASTIC_RM_CKPT_PEERS for this round's workers."""
    peers = peer_endpoints(services)
    return None if peers is None else encode_peers(peers)


def set_worker_env(services: NodeServices | None) -> None:
    """Called at every worker start (a new round, new peers)."""
    try:
        value = peers_env(services)
    except Exception as e:  # noqa: BLE001 - etcd trouble must not stop the workers; restores use local + durable
        log.warning(
            "checkpoint peers unknown for this round (%s): workers restore from local memory and the "
            "durable copy only",
            e,
        )
        value = None
    if value is None:
        os.environ.pop(PEERS_ENV, None)
    else:
        os.environ[PEERS_ENV] = value


# ---- a stand-alone server (tests, debugging) -----------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve one node's flash-checkpoint memory directory.")
    ap.add_argument("--dir", required=True, type=Path, help="the node's memory directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    args = ap.parse_args(argv)
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"set {TOKEN_ENV} to the bearer token peers will use")
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with CheckpointServer(args.dir, args.host, args.port, token) as server:
        if args.port_file:
            tmp = args.port_file.with_name(args.port_file.name + ".tmp")
            tmp.write_text(str(server.port))
            tmp.replace(args.port_file)
        while not stop.wait(1.0):
            pass


if __name__ == "__main__":
    main()
