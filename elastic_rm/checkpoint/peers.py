"""The worker's side of the checkpoint transport between nodes: who the peers are (the agent's
ELASTIC_RM_CKPT_PEERS), and a small HTTP client for a peer agent's checkpoint server
(elastic_rm/checkpoint/http.py): list steps, fetch a manifest, download a file, push a replica.

Light on purpose (stdlib only): the agent imports the names shared with its server from here.
Everything on the wire is JSON or raw checkpoint bytes. One of those files, DCP's `.metadata`, is a
pickle: restore reads it with a restricted unpickler that admits only DCP's metadata classes
(elastic_rm/checkpoint/dcp_metadata.py), so a peer's bytes never reach an unrestricted pickle.load.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import timeline
from .manifest import MANIFEST, step_dirname
from .peer_tls import PeerTls, tls_from_env
from .retention import Link, missing_from, read_links

PEERS_ENV = "ELASTIC_RM_CKPT_PEERS"  # JSON: {"v": 1, "peers": [{"node", "url", "token"}]}, set by the agent
API = "/v1"
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")  # node ids and checkpoint file names on the wire
CHUNK = 4 << 20
CHAIN_MISSING = 424  # the server's answer to a delta step whose chain it does not hold


def _own_files(manifest: dict[str, Any], node: str) -> list[str]:
    """The files of `node` in a step's manifest, and the files every node shares (node "*")."""
    return sorted(n for n, e in manifest["files"].items() if e.get("node") in (node, "*"))


def safe_name(name: str) -> bool:
    """A plain name that cannot leave its directory (no separators, no '.', '..', no escapes)."""
    return bool(SAFE_NAME.match(name)) and name not in (".", "..")


class PeerError(RuntimeError):
    """A peer's checkpoint server could not be reached or refused a request; the message says which."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class PeerEndpoint:
    """A peer node's checkpoint server. The token is kept out of repr (configs get logged)."""

    node: str
    url: str
    token: str = field(repr=False)

    @property
    def hostport(self) -> tuple[str, int]:
        u = urlsplit(self.url)
        assert u.hostname is not None and u.port is not None
        return u.hostname, u.port


def encode_peers(peers: list[PeerEndpoint]) -> str:
    return json.dumps({"v": 1, "peers": [{"node": p.node, "url": p.url, "token": p.token} for p in peers]})


def parse_peers(text: str, where: str = PEERS_ENV) -> list[PeerEndpoint]:
    """Strict: a malformed value is an error naming the variable (the agent wrote it; a bad one is a bug)."""

    def bad(what: str) -> ValueError:
        return ValueError(f'{where}: {what}; expected {{"v": 1, "peers": [{{"node", "url", "token"}}]}}')

    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("v") != 1 or not isinstance(doc.get("peers"), list):
        raise bad("not a v1 peer list")
    out = []
    for p in doc["peers"]:
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) for k in ("node", "url", "token")):
            raise bad(f"entry {p!r} needs string fields node, url, token")
        if not safe_name(p["node"]) or not p["token"]:
            raise bad(f"entry for node {p['node']!r}: bad node id or empty token")
        u = urlsplit(p["url"])
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme not in ("http", "https") or not u.hostname or not port or u.path not in ("", "/"):
            raise bad(f"entry for node {p['node']!r}: url {p['url']!r} is not http(s)://host:port")
        out.append(PeerEndpoint(p["node"], p["url"].rstrip("/"), p["token"]))
    return out


def peers_from_env() -> dict[str, PeerEndpoint] | None:
    """The peers the agent gave this worker (node id -> endpoint); None without an agent (torchrun)."""
    text = os.environ.get(PEERS_ENV)
    if not text:
        return None
    return {p.node: p for p in parse_peers(text)}


class PeerClient:
    """Requests to one peer's checkpoint server; every call is bounded by `timeout_s` per socket operation.

    An ``https://`` peer is reached with ``tls`` (default: the files the agent gave, ELASTIC_RM_CKPT_TLS):
    its certificate must chain to the job's CA and this side presents its own. When the agent says TLS is
    required, a plain ``http://`` peer is refused before anything is sent."""

    def __init__(self, peer: PeerEndpoint, timeout_s: float = 30.0, tls: PeerTls | None = None) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        required = False
        if tls is None:
            tls, required = tls_from_env()
        self._tls = tls
        self._required = required or tls is not None
        self._context: ssl.SSLContext | None = None
        # one connection kept open between requests: replica pushes (_request(reuse=True)) and a
        # restore's file and span reads (_get_into); close() ends it
        self._kept: http.client.HTTPConnection | None = None

    def _conn(self) -> http.client.HTTPConnection:
        host, port = self.peer.hostport
        if not self.peer.url.startswith("https://"):
            if self._required:
                raise PeerError(
                    f"{self.peer.node} ({self.peer.url}): refusing plain HTTP: this node's checkpoint "
                    "transport requires TLS (every node needs the etcd CA and a client certificate)"
                )
            return http.client.HTTPConnection(host, port, timeout=self.timeout_s, blocksize=1 << 20)
        if self._tls is None:
            raise PeerError(
                f"{self.peer.node} ({self.peer.url}) serves HTTPS but this node has no TLS files: give its "
                "agent the etcd CA and a client certificate and key (--etcd-cacert/--etcd-cert/--etcd-key)"
            )
        if self._context is None:
            self._context = self._tls.client_context()
        return http.client.HTTPSConnection(
            host, port, timeout=self.timeout_s, blocksize=1 << 20, context=self._context
        )

    def _tls_error(self, what: str, e: ssl.SSLError) -> PeerError:
        return PeerError(
            f"{self.peer.node} ({self.peer.url}): {what}: TLS handshake failed ({e.reason or e}): both "
            "sides need a certificate signed by the job's CA (the etcd CA, --etcd-cacert)"
        )

    def _headers(self, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.peer.token}", **extra}

    def _fail(self, what: str, resp: http.client.HTTPResponse) -> PeerError:
        body = resp.read(4096)
        try:
            msg = json.loads(body).get("error", "")
        except (ValueError, AttributeError):
            msg = body.decode(errors="replace")
        return PeerError(f"{self.peer.node} ({self.peer.url}): {what}: HTTP {resp.status} {msg}", resp.status)

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        reuse: bool = False,
        timeout_s: float | None = None,
    ) -> bytes:
        """A whole small response body; PeerError on any failure (404 included, with status 404).

        ``reuse``: send it on the connection this client keeps open (replica pushes: a checkpoint at
        every step would otherwise pay a TCP connect, and a server thread, per request). A kept
        connection the server has closed meanwhile (its idle timeout) is opened again once, for a
        body that can be sent again (bytes, none, or a file: sent again from its start).
        ``timeout_s``: this request's bound per socket operation, on a connection of its own (a request
        whose answer takes long to come, such as a fold)."""
        conn = self._kept if reuse and self._kept is not None and timeout_s is None else self._conn()
        if timeout_s is not None:
            conn.timeout = timeout_s  # not connected yet: the socket takes it
        stale_ok = conn is self._kept and (not hasattr(body, "read") or hasattr(body, "seek"))
        try:
            try:
                self._send(conn, method, path, body, headers or {})
                resp = conn.getresponse()
            except ssl.SSLError:
                raise
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not stale_ok:
                    raise
                conn.close()  # the server closed the kept connection: once more on a new one
                if hasattr(body, "seek"):
                    body.seek(0)
                self._send(conn, method, path, body, headers or {})
                resp = conn.getresponse()
            except OSError:  # the server may have answered (401, 413, 507) and closed while we were sending
                if conn.sock is None:  # not even connected
                    raise
                resp = conn.getresponse()
                raise self._fail(f"{method} {path}", resp) from None
            if reuse:
                self._kept = conn
            if resp.status != 200:
                raise self._fail(f"{method} {path}", resp)
            return resp.read()
        except ssl.SSLError as e:
            self._drop(conn)
            raise self._tls_error(f"{method} {path}", e) from e
        except (OSError, http.client.HTTPException) as e:
            self._drop(conn)
            raise PeerError(f"{self.peer.node} ({self.peer.url}): {method} {path}: {e}") from e
        except PeerError:
            self._drop(conn)  # a refusal's answer may close the connection: the next request opens one
            raise
        finally:
            if conn is not self._kept:
                conn.close()

    def _send(
        self, conn: http.client.HTTPConnection, method: str, path: str, body: Any, headers: dict[str, str]
    ) -> None:
        """conn.request, except that a file's body goes out by sendfile: the kernel sends it from the
        file's pages, where http.client would read it into this process and write it to the socket
        (a replica's files at every save). Over TLS, sendfile falls back to reads and sends."""
        if not hasattr(body, "fileno"):
            conn.request(method, API + path, body=body, headers=self._headers(**headers))
            return
        conn.putrequest(method, API + path)
        for name, value in self._headers(**headers).items():
            conn.putheader(name, value)
        conn.endheaders()
        assert conn.sock is not None  # endheaders() connected
        conn.sock.sendfile(body)

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if conn is self._kept:
            self._kept = None

    def close(self) -> None:
        """Close the connection kept open between requests (replica pushes, a restore's reads), if
        any: it holds a thread of the peer's server until the server times it out. The client opens
        a new one on its next request."""
        if self._kept is not None:
            self._kept.close()
            self._kept = None

    # ---- reading a peer's memory --------------------------------------------------------------
    def steps(self) -> list[int]:
        return self.listing()[0]

    def listing(self) -> tuple[list[int], Any]:
        """The steps the peer holds (its own and its replicas') and the newest timeline their manifests
        name (timeline.py; as the manifest field, None when it holds none or does not say)."""
        body = self._request("GET", "/steps")

        def bad(what: str) -> PeerError:
            return PeerError(f"{self.peer.node} ({self.peer.url}): malformed step listing: {what}")

        # Strict, as a PeerError naming the peer: a body that is not the listing's shape (bytes from the
        # network) must not crash the restore's first read (a TypeError), and a malformed timeline must
        # not be dropped quietly, which would leave this peer's steps in a vote that ignored its timeline
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise bad(f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise bad("not a JSON object")
        steps, replicas = doc.get("steps", []), doc.get("replicas", {})
        if (
            not isinstance(steps, list)
            or not isinstance(replicas, dict)
            or not all(isinstance(v, list) for v in replicas.values())
        ):
            raise bad("'steps' must be a list and 'replicas' an object of lists")
        found = [*steps, *(s for v in replicas.values() for s in v)]
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in found):
            raise bad("steps must be integers >= 0")
        why = timeline.check_field(doc.get("timeline"))
        if why is not None:
            raise bad(why)
        return sorted(set(found)), doc.get("timeline")

    def manifest(self, step: int) -> bytes | None:
        """On the kept connection: a restore asks for several manifests in a row (a chain's)."""
        try:
            return self._request("GET", f"/steps/{step}/manifest", reuse=True)
        except PeerError as e:
            if e.status == 404:
                return None
            raise

    def download(
        self,
        step: int,
        file: str,
        dest: Path,
        spans: list[tuple[int, int]] | None = None,
        size: int = 0,
        into_existing: bool = False,
    ) -> int | None:
        """Stream a file of `step` into `dest` (written as dest.part, then renamed); the bytes received,
        or None when the peer does not hold it. With `spans` ((offset, length) pairs) only those bytes are
        fetched (HTTP range requests) into a file of `size` bytes: the rest stays zero and unread.
        ``into_existing``: the spans are written into `dest` itself, a copy holding other spans of the
        file (a resharding reader asking for more of it); a failure midway leaves bytes in those spans
        that the caller must not trust until it has fetched them whole."""
        if not safe_name(file):
            raise PeerError(f"refusing to request file {file!r}: not a plain file name")
        if into_existing and spans is None:
            raise ValueError("into_existing needs spans: a whole file is written as a new copy")
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest if into_existing else dest.with_name(dest.name + ".part")
        path = f"/steps/{step}/files/{file}"
        try:
            with open(part, "r+b" if into_existing else "wb") as f:
                if spans is None:
                    got = self._get_into(path, f, None)
                else:
                    if not into_existing:
                        f.truncate(size)
                    got = 0
                    for off, n in spans:
                        r = self._get_into(path, f, (off, n))
                        got += r if r is not None else 0
                        if r is None:
                            break
            if got is None or (spans is not None and got != sum(n for _, n in spans)):
                return None
            if not into_existing:
                os.replace(part, dest)
            return got
        except ssl.SSLError as e:
            raise self._tls_error(f"GET {path}", e) from e
        except (OSError, http.client.HTTPException) as e:
            raise PeerError(f"{self.peer.node} ({self.peer.url}): GET {path}: {e}") from e
        finally:
            if not into_existing:
                part.unlink(missing_ok=True)

    def _get_into(self, path: str, f: Any, span: tuple[int, int] | None) -> int | None:
        """GET `path` (or one byte span of it) into `f` at the span's offset; None on 404. On the
        connection this client keeps (see _request(reuse=True)): a restore asks a peer for many small
        spans, and a TCP connect and a server thread per span cost more than most spans. A kept
        connection the server has closed meanwhile is opened again once."""
        headers = self._headers()
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[0] + span[1] - 1}"
        for fresh in (False, True):
            kept = not fresh and self._kept is not None
            conn = self._kept if kept and self._kept is not None else self._conn()
            self._kept = None  # this request's until its answer is read whole
            if span is not None:
                f.seek(span[0])
            try:
                conn.request("GET", API + path, headers=headers)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if kept:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            return self._read_into(conn, resp, path, headers, f, span)
        raise AssertionError("unreachable: the second try uses a new connection")

    def _read_into(
        self,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        path: str,
        headers: dict[str, str],
        f: Any,
        span: tuple[int, int] | None,
    ) -> int | None:
        """The answer of _get_into written into `f`; the connection is kept once it was read whole."""
        whole = False
        try:
            if resp.status == 404:
                resp.read(4096)
                return None
            if resp.status != (200 if span is None else 206):
                raise self._fail(f"GET {path} ({headers.get('Range', 'whole file')})", resp)
            # as http.client parsed it (None: absent, negative or not a number): such an answer is a
            # PeerError naming the peer, not a ValueError out of the restore
            if resp.length is None:
                raise PeerError(f"{self.peer.node}: GET {path}: an answer without a valid Content-Length")
            length = resp.length
            got = 0
            # no larger than the span: a restore asks for many small spans (a delta's header, the
            # checksum blocks of its entries), and a zeroed buffer of CHUNK per request cost more than them
            view = memoryview(bytearray(CHUNK if span is None else min(CHUNK, span[1])))
            while n := resp.readinto(view):
                f.write(view[:n])
                got += n
            if got != length or (span is not None and got != span[1]):
                raise PeerError(f"{self.peer.node}: GET {path}: got {got} of {length} bytes (connection cut)")
            whole = True
            return got
        finally:
            if whole and not resp.will_close and self._kept is None:
                self._kept = conn
            else:
                conn.close()

    # ---- keeping a replica on a peer ----------------------------------------------------------
    def push_replica(
        self, src: str, step: int, step_dir: Path, files: list[str], manifest: bytes, keep: int
    ) -> int:
        """Upload `files` of `step_dir` as `src`'s replica of `step`, then commit it with `manifest`
        (the server checks every file against it and publishes atomically). Returns the bytes sent.

        A delta step is accepted only on top of its chain. When the peer lacks part of it (a new ring
        peer after a change of the world, a restarted one), it answers 424: the chain's missing steps
        are then pushed from this node's memory (the directory holding `step_dir`), base first, and the
        delta again. Only this node's files of each step go (and the step's shared ``.metadata``)."""
        try:
            return self._push_step(src, step, step_dir, files, manifest, keep)
        except PeerError as e:
            if e.status != CHAIN_MISSING:
                raise
        node_dir = step_dir.parent
        links = read_links(node_dir)
        held = self.replica_links(src)
        try:
            missing = missing_from(links, held, step)
        except ValueError as e:
            raise PeerError(f"{self.peer.node} ({self.peer.url}): replica of step {step}: {e}") from None
        sent = 0
        for s in missing:
            d = node_dir / step_dirname(s)
            body = (d / MANIFEST).read_bytes()
            mine = _own_files(json.loads(body), src) if s != step else files
            sent += self._push_step(src, s, d, mine, body, keep)
        return sent

    def fold_replica(self, src: str, step: int, manifest: bytes, keep: int, timeout_s: float) -> None:
        """Ask the peer to fold `src`'s replica chain into its base in place, up to `step`, the folded
        base `manifest` describes (elastic_rm/checkpoint/inplace.py). PeerError when it cannot. The
        answer comes once the fold is done (a pass over the replica's base): `timeout_s` bounds the
        wait, not the client's per-operation timeout."""
        self._request(
            "POST",
            f"/replicas/{src}/{step}/fold?keep={keep}",
            body=manifest,
            headers={"Content-Type": "application/json"},
            timeout_s=timeout_s,
        )

    def replica_links(self, src: str) -> dict[int, Link]:
        """The steps this peer holds for `src`, with their manifests' chain fields."""
        body = self._request("GET", f"/replicas/{src}/links", reuse=True)
        try:
            doc = json.loads(body)
            return {int(d["step"]): Link(**d) for d in doc["links"]}
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
            raise PeerError(f"{self.peer.node} ({self.peer.url}): malformed replica links of {src}") from None

    def _push_step(
        self, src: str, step: int, step_dir: Path, files: list[str], manifest: bytes, keep: int
    ) -> int:
        base = f"/replicas/{src}/{step}"
        if not files:
            self._request("POST", base + "/begin", body=b"", reuse=True)
        sent = 0
        for i, name in enumerate(files):
            size = (step_dir / name).stat().st_size
            with open(step_dir / name, "rb") as f:
                self._request(
                    "PUT",
                    f"{base}/files/{name}" + ("?begin=1" if i == 0 else ""),  # the first file begins
                    body=f,
                    headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
                    reuse=True,
                )
            sent += size
        self._request(
            "POST",
            f"{base}/commit?keep={keep}",
            body=manifest,
            headers={"Content-Type": "application/json"},
            reuse=True,
        )
        return sent
