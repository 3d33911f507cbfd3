"""The checkpoint transport between nodes: the agent's checkpoint server (real processes, real HTTP on
loopback), the worker's client and HttpPeerSource, and the records that publish the server."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from elastic_rm.agent.ckpt_hooks import peers_env
from elastic_rm.background import HttpThread
from elastic_rm.checkpoint.http import CheckpointHttpServer
from elastic_rm.checkpoint.local_servers import NodeServer, node_servers
from elastic_rm.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    digest,
    file_entry,
    make_manifest,
    step_dirname,
)
from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError, parse_peers
from elastic_rm.checkpoint.server import CheckpointServer
from elastic_rm.checkpoint.sources import DirectorySource, FileResolver, HttpPeerSource
from elastic_rm.checkpoint.store import CheckpointStore
from elastic_rm.wire.records import NodeRecord, RecordError, dumps


def make_step(
    node_dir: Path, step: int, files: dict[str, bytes], node: str = "n0", manifest: bool = True
) -> bytes:
    """A committed step directory as the flash checkpoint writes it; returns the manifest bytes."""
    d = node_dir / step_dirname(step)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    entries = {n: file_entry(d / n, node="*" if n == ".metadata" else node, rank=0) for n in files}
    body = make_manifest(
        {"step": step, "world_size": 1, "nodes": [node], "position": {"step": step}, "files": entries}
    )
    if manifest:
        (d / "manifest.json").write_bytes(body)
    return body


def client(s: NodeServer, token: str | None = None) -> PeerClient:
    return PeerClient(PeerEndpoint(s.node, s.url, token or s.token), timeout_s=60)


def raw(
    s: NodeServer, method: str, path: str, token: str | None, body: bytes = b"", headers: dict | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    headers = {"Content-Length": str(len(body)), **(headers or {})}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def servers(tmp_path: Path):
    root = tmp_path / "shm"
    with node_servers(root, ["n0", "n1"]) as s:
        yield root, s


def test_server_lists_serves_manifest_and_files(servers) -> None:
    root, s = servers
    data = os.urandom(3 << 20)
    body = make_step(root / "n0", 4, {"__0_0.distcp": data, ".metadata": b"meta"})
    make_step(root / "n0", 6, {"__0_0.distcp": b"partial"}, manifest=False)  # not committed: not listed
    make_step(root / "n0" / "replicas" / "n7", 5, {"__7_0.distcp": b"held for n7"}, node="n7")
    c = client(s["n0"])
    assert c.steps() == [4, 5]
    assert c.manifest(4) == body
    assert c.manifest(6) is None
    assert c.download(4, "__0_0.distcp", root / "got" / "a") and (root / "got" / "a").read_bytes() == data
    assert (
        c.download(5, "__7_0.distcp", root / "got" / "b")
        and (root / "got" / "b").read_bytes() == b"held for n7"
    )
    assert not c.download(4, "__9_0.distcp", root / "got" / "c")  # not in the manifest: 404
    assert not (root / "got" / "c").exists() and not (root / "got" / "c.part").exists()
    status, listing = raw(s["n0"], "GET", "/v1/steps", s["n0"].token)
    assert status == 200 and json.loads(listing)["replicas"] == {"n7": [5]}


def test_every_route_needs_the_token(servers) -> None:
    root, s = servers
    make_step(root / "n0", 4, {"__0_0.distcp": b"secret shard"})
    routes = [
        ("GET", "/v1/steps"),
        ("GET", "/v1/steps/4/manifest"),
        ("GET", "/v1/steps/4/files/__0_0.distcp"),
        ("POST", "/v1/replicas/n9/4/begin"),
        ("PUT", "/v1/replicas/n9/4/files/__9_0.distcp"),
        ("POST", "/v1/replicas/n9/4/commit"),
        ("GET", "/v1/nothing"),
    ]
    for method, path in routes:
        for token in (None, "wrong", s["n1"].token):  # no token, a wrong one, another node's
            status, body = raw(s["n0"], method, path, token, b"x" * 10)
            assert status == 401 and b"secret" not in body, (method, path, token, status, body)
    with pytest.raises(PeerError, match="HTTP 401"):
        client(s["n0"], token="wrong").steps()
    assert not (root / "n0" / "replicas").exists()


def test_paths_cannot_escape_the_node_directory(servers) -> None:
    root, s = servers
    make_step(root / "n0", 4, {"__0_0.distcp": b"shard"})
    (root / "outside.txt").write_bytes(b"TOP SECRET")
    (root / "n1" / step_dirname(4)).mkdir(parents=True)
    (root / "n1" / step_dirname(4) / "x").write_bytes(b"TOP SECRET")
    tok = s["n0"].token
    bad = [
        ("GET", "/v1/steps/4/files/..%2f..%2foutside.txt"),
        ("GET", "/v1/steps/4/files/../../outside.txt"),
        ("GET", "/v1/steps/4/files/%2e%2e"),
        ("GET", "/v1/steps/4/files/manifest.json/../../../n1/step-00000004/x"),
        ("GET", "/v1/steps/..%2f..%2fn1/manifest"),
        ("GET", "/v1/steps/-1/manifest"),
        ("GET", "/v1/steps/4e2/manifest"),
        ("GET", "/v1//steps"),
        ("POST", "/v1/replicas/../4/begin"),
        ("POST", "/v1/replicas/..%2f..%2fn1/4/begin"),
        ("POST", "/v1/replicas/n9/4/files/..%2fx"),
    ]
    for method, path in bad:
        status, body = raw(s["n0"], method, path, tok)
        assert status in (400, 404) and b"TOP SECRET" not in body, (path, status, body)
    status, _ = raw(s["n0"], "GET", "/v1/steps/4/files/..", tok)
    assert status == 400
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".port-n0", ".port-n1", "n0", "n1", "outside.txt"]
    )
    with pytest.raises(PeerError, match="not a plain file name"):
        client(s["n0"]).download(4, "../outside.txt", root / "x")


def test_replica_push_is_verified_and_committed_atomically(servers, tmp_path: Path) -> None:
    root, s = servers
    files = {"__0_0.distcp": os.urandom(1 << 20), "__1_0.distcp": os.urandom(1000), ".metadata": b"meta"}
    src = tmp_path / "src"
    body = make_step(src, 8, files)
    c = client(s["n1"])
    names = sorted(files)
    c.push_replica("n0", 8, src / step_dirname(8), names, body, keep=2)
    held = root / "n1" / "replicas" / "n0" / step_dirname(8)
    assert sorted(p.name for p in held.iterdir()) == sorted([*names, "manifest.json"])
    assert all((held / n).read_bytes() == files[n] for n in names)
    assert c.steps() == [8]

    # a file that no longer matches the manifest (flipped in memory or in transit): refused, nothing kept
    body9 = make_step(src, 9, files)
    flipped = bytes([files["__1_0.distcp"][0] ^ 0xFF]) + files["__1_0.distcp"][1:]  # never the same byte
    (src / step_dirname(9) / "__1_0.distcp").write_bytes(flipped)
    with pytest.raises(PeerError, match=r"HTTP 422 .*__1_0.distcp: size/checksum do not match"):
        c.push_replica("n0", 9, src / step_dirname(9), names, body9, keep=2)
    # a missing file and a torn manifest: refused too
    with pytest.raises(PeerError, match=r"HTTP 422 .*__0_0.distcp: missing"):
        c.push_replica("n0", 9, src / step_dirname(9), [".metadata"], body9, keep=2)
    with pytest.raises(PeerError, match="HTTP 422 .*manifest checksum mismatch"):
        c.push_replica(
            "n0", 9, src / step_dirname(8), names, body9.replace(b'"step": 9', b'"step": 7'), keep=2
        )
    assert sorted(p.name for p in held.parent.iterdir()) == [step_dirname(8)]
    assert c.steps() == [8]

    # a file upload outside begin/commit is refused; a good push prunes to `keep`
    status, _ = raw(s["n1"], "PUT", "/v1/replicas/n0/10/files/__0_0.distcp", s["n1"].token, b"abc")
    assert status == 409
    for step in (10, 11):
        c.push_replica("n0", step, src / step_dirname(8), names, make_step(src, step, files), keep=2)
    assert sorted(p.name for p in held.parent.iterdir()) == [step_dirname(10), step_dirname(11)]


def test_upload_limits(tmp_path: Path) -> None:
    with CheckpointServer(tmp_path / "n0", max_file_bytes=1000) as server:
        c = PeerClient(PeerEndpoint("n0", server.url, server.token))
        src = tmp_path / "src"
        body = make_step(src, 1, {"__0_0.distcp": b"y" * 5000})
        with pytest.raises(PeerError, match="HTTP 413"):
            c.push_replica("n9", 1, src / step_dirname(1), ["__0_0.distcp"], body, keep=2)
        assert server.store.listing()["replicas"] == {"n9": []}


def test_concurrent_downloads(servers) -> None:
    root, s = servers
    files = {f"__{r}_0.distcp": os.urandom(4 << 20) for r in range(4)}
    make_step(root / "n0", 3, files)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def fetch(i: int) -> None:
        name = f"__{i % 4}_0.distcp"
        try:
            dest = root / "dl" / str(i) / name
            assert client(s["n0"]).download(3, name, dest)
            results[i] = hashlib.sha256(dest.read_bytes()).hexdigest()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {i: hashlib.sha256(files[f"__{i % 4}_0.distcp"]).hexdigest() for i in range(12)}


def test_http_source_verifies_downloads_and_skips_dead_peers(servers, tmp_path: Path, caplog) -> None:
    root, s = servers
    files = {"__0_0.distcp": os.urandom(1 << 20), ".metadata": b"meta"}
    body = make_step(root / "n0", 2, files)
    make_step(root / "n1", 2, files)
    (root / "n1" / step_dirname(2) / "__0_0.distcp").write_bytes(b"\0" * (1 << 20))  # n1's copy is corrupt
    with node_servers(tmp_path / "dead", ["n9"]) as dead:
        dead_peer = PeerEndpoint("n9", dead["n9"].url, dead["n9"].token)
        dead["n9"].proc.kill()
        dead["n9"].proc.wait(30)
    cache = tmp_path / "cache"
    gone = HttpPeerSource(dead_peer, cache / "n9", timeout_s=10)
    corrupt = HttpPeerSource(PeerEndpoint("n1", s["n1"].url, s["n1"].token), cache / "n1", timeout_s=10)
    good = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), cache / "n0", timeout_s=10)
    sources = [gone, corrupt, good, DirectorySource("durable", tmp_path / "nothing")]
    with caplog.at_level(logging.WARNING):
        assert gone.steps() == [] and gone.down
        assert corrupt.steps() == [2] and good.manifest_bytes(2) == body
        resolver = FileResolver(2, json.loads(body), sources)
        path = resolver.path("__0_0.distcp")
    assert path.read_bytes() == files["__0_0.distcp"] and resolver.resolved["__0_0.distcp"][0] == "peer:n0"
    text = caplog.text
    assert "peer:n9" in text and "trying the next" in text
    assert "__0_0.distcp in peer:n1 is checksum mismatch" in text
    assert good.bytes_fetched == 1 << 20
    good.clear()
    assert not (cache / "n0").exists()
    # no good copy anywhere: the error names every source and why
    with pytest.raises(
        CorruptCheckpointError, match=r"peer:n9: peer unreachable.*peer:n1: checksum mismatch"
    ):
        FileResolver(2, json.loads(body), [gone, corrupt]).path("__0_0.distcp")


def test_peer_list_and_node_record_are_strict() -> None:
    good = {"node": "n1", "url": "http://10.0.0.2:8000", "token": "s3cr3t"}
    peers = parse_peers(json.dumps({"v": 1, "peers": [good]}))
    assert peers == [PeerEndpoint("n1", "http://10.0.0.2:8000", "s3cr3t")] and "s3cr3t" not in repr(peers)
    for bad in (
        "not json",
        json.dumps({"v": 2, "peers": []}),
        json.dumps({"v": 1, "peers": [{"node": "n1", "url": "ftp://h:1", "token": "t"}]}),
        json.dumps({"v": 1, "peers": [{"node": "n1", "url": "http://h", "token": "t"}]}),
        json.dumps({"v": 1, "peers": [{"node": "../n1", "url": "http://h:1", "token": "t"}]}),
        json.dumps({"v": 1, "peers": [{"node": "n1", "url": "http://h:1", "token": ""}]}),
    ):
        with pytest.raises(ValueError, match="ELASTIC_RM_CKPT_PEERS"):
            parse_peers(bad)
    base = {"v": 1, "node": "n1", "host": "h", "addr": "10.0.0.2", "pid": 1, "nproc": 1, "state": "active"}
    old = NodeRecord.parse("k", json.dumps(base).encode())
    assert (old.ckpt_port, old.ckpt_token) == (0, "")
    rec = NodeRecord.parse("k", json.dumps({**base, "ckpt_port": 8000, "ckpt_token": "s3cr3t"}).encode())
    assert (rec.ckpt_port, rec.ckpt_token) == (8000, "s3cr3t") and "s3cr3t" not in repr(rec)
    assert NodeRecord.parse("k", dumps(rec)) == rec
    for field, value in (("ckpt_port", "8000"), ("ckpt_port", 70000), ("ckpt_port", True), ("ckpt_token", 5)):
        with pytest.raises(RecordError, match=field):
            NodeRecord.parse("k", json.dumps({**base, field: value}).encode())

    class Services:  # what the agent asks of the node services at each worker start
        checkpoint_tls = (None, False)

        def checkpoint_peers(self) -> dict[str, tuple[str, int, str]]:
            return {"n2": ("::1", 9001, "b"), "n1": ("10.0.0.2", 9000, "a")}

    env = parse_peers(peers_env(Services()) or "")  # type: ignore[arg-type]
    assert env == [
        PeerEndpoint("n1", "http://10.0.0.2:9000", "a"),
        PeerEndpoint("n2", "http://[::1]:9001", "b"),
    ]
    assert (
        peers_env(None) is None
    )  # torch's handlers (no node services): no peers, restores use local + durable


def test_agents_publish_their_servers_through_the_rendezvous(etcd, run_id) -> None:
    """What each ermrun agent does: start its server on the node's address, publish port and token in
    its node record before joining; then each worker start gets the round's other members."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_rm.agent.ckpt_hooks import start_for_agent
    from elastic_rm.checkpoint.node_memory import run_memory_dir
    from elastic_rm.checkpoint.peers import parse_peers
    from elastic_rm.rendezvous.registration import create_handler

    conf = {"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "60"}
    params = RendezvousParameters("elastic-rm", etcd.endpoint, run_id, 2, 2, local_addr="127.0.0.1", **conf)
    handlers = [create_handler(params) for _ in range(2)]
    servers = []
    try:
        servers = [start_for_agent(h.services, run_id) for h in handlers]
        assert all(s is not None and s.host == "127.0.0.1" for s in servers)
        for h in handlers:
            make_step(run_memory_dir(run_id) / h.node_id, 7, {"__0_0.distcp": h.node_id.encode()})
        errors: list[BaseException] = []

        def join(h) -> None:
            try:
                h.next_rendezvous()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        for me, other in ((0, 1), (1, 0)):
            peers = parse_peers(peers_env(handlers[me].services) or "")
            assert [p.node for p in peers] == [handlers[other].node_id]
            assert peers[0].url == servers[other].url and peers[0].token == servers[other].token
            dest = run_memory_dir(run_id) / "got" / str(me)
            assert PeerClient(peers[0]).steps() == [7] and PeerClient(peers[0]).download(
                7, "__0_0.distcp", dest
            )
            assert dest.read_bytes() == handlers[other].node_id.encode()
    finally:
        for s in servers:
            if s is not None:
                s.stop()
        for h in handlers:
            h.shutdown()
        shutil.rmtree(run_memory_dir(run_id), ignore_errors=True)


def test_range_requests_fetch_only_the_blocks_a_reader_needs(servers, tmp_path: Path) -> None:
    root, s = servers
    mib = 1 << 20
    data = os.urandom(5 * mib + 123)
    make_step(root / "n0", 1, {"__0_0.distcp": data})
    # one span of the file: 206; anything else: 416
    status, body = raw(
        s["n0"], "GET", "/v1/steps/1/files/__0_0.distcp", s["n0"].token, headers={"Range": "bytes=10-19"}
    )
    assert status == 206 and body == data[10:20]
    for bad in ("bytes=5-2", f"bytes=0-{len(data)}", "bytes=0-1,3-4", "bytes=-5", "items=0-1"):
        status, _ = raw(
            s["n0"], "GET", "/v1/steps/1/files/__0_0.distcp", s["n0"].token, headers={"Range": bad}
        )
        assert status == 416, bad
    # a manifest entry with 1 MiB checksum blocks (the real ones use 16 MiB)
    blocks = [digest(data[o : o + mib]) for o in range(0, len(data), mib)]
    entry = {"xxh3_128": digest(data), "size": len(data), "block": mib, "blocks": blocks}
    manifest = {"files": {"__0_0.distcp": {**entry, "node": "n0", "rank": 0}}}
    ranges = [(mib + mib // 2, mib // 5), (3 * mib + 10, 5)]  # blocks 1 and 3
    src = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), tmp_path / "cache", timeout_s=30)
    path = FileResolver(1, manifest, [src]).path("__0_0.distcp", ranges)
    got = path.read_bytes()
    assert src.bytes_fetched == 2 * mib and len(got) == len(data)
    assert got[mib : 2 * mib] == data[mib : 2 * mib] and got[3 * mib : 4 * mib] == data[3 * mib : 4 * mib]
    assert got[:mib] == bytes(mib)  # never fetched, never read
    # a flipped byte in a block the reader needs is caught; in a block it does not read, it does not matter
    on_peer = root / "n0" / step_dirname(1) / "__0_0.distcp"
    flipped = bytearray(data)
    flipped[10] ^= 0xFF
    on_peer.write_bytes(bytes(flipped))
    assert (
        FileResolver(1, manifest, [src]).path("__0_0.distcp", ranges).read_bytes()[mib : 2 * mib]
        == data[mib : 2 * mib]
    )
    with pytest.raises(CorruptCheckpointError, match=r"peer:n0: checksum mismatch in block 0"):
        FileResolver(1, manifest, [src]).path("__0_0.distcp", [(0, 100)])


def test_a_body_cut_by_the_timeout_closes_the_connection(tmp_path: Path) -> None:
    """After an upload timed out mid-body, what the client sends next is not read as a request."""
    with CheckpointServer(tmp_path / "n0", timeout_s=0.3) as server:
        head = f"HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(f"POST /v1/replicas/n1/10/begin {head}Content-Length: 0\r\n\r\n".encode())
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):  # begin's answer, body included
                chunk = conn.recv(4096)
                assert chunk, f"the server closed the connection after {got!r}"
                got += chunk
            assert got.startswith(b"HTTP/1.0 200") or got.startswith(b"HTTP/1.1 200"), got
            conn.sendall(
                f"PUT /v1/replicas/n1/10/files/a.bin {head}Content-Length: 100\r\n\r\n".encode() + b"x" * 10
            )
            time.sleep(1.0)  # past the server's socket timeout: the upload is cut
            try:
                conn.sendall(f"GET /v1/steps {head}\r\n".encode())
                answer = conn.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                answer = b""
            assert answer == b"", f"the rest of a cut body was read as a request: {answer[:80]!r}"


class CountingServer(CheckpointHttpServer):
    """The checkpoint server's HTTP server, counting the connections it accepts."""

    accepted = 0

    def get_request(self) -> tuple[socket.socket, object]:
        self.accepted += 1
        return super().get_request()


def test_a_restore_reads_its_spans_from_a_peer_on_one_connection(tmp_path: Path) -> None:
    """Many small range reads (a delta's header, then the blocks of its entries) and the manifests go
    over one kept connection, each span read whole and right into the one local copy of the file, beside
    the blocks read before; clear() after the load closes it, and reads after that open a new one."""
    data = os.urandom(64 << 10)
    step_dir = tmp_path / "n0" / step_dirname(1)
    step_dir.mkdir(parents=True)
    (step_dir / "f.erm").write_bytes(data)
    block = 4 << 10
    blocks = [digest(data[o : o + block]) for o in range(0, len(data), block)]
    entry = {"xxh3_128": digest(data), "size": len(data), "block": block, "blocks": blocks, "node": "n0"}
    body = {"step": 1, "world_size": 1, "position": {}, "files": {"f.erm": entry}}
    (step_dir / MANIFEST).write_bytes(make_manifest(body))
    server = CountingServer("127.0.0.1", 0, CheckpointStore(tmp_path / "n0"), "tok", 30.0)
    http_thread = HttpThread(server, "test-ckpt-server")
    try:
        peer = PeerEndpoint("n0", f"http://127.0.0.1:{http_thread.port}", "tok")
        src = HttpPeerSource(peer, tmp_path / "cache", timeout_s=30)

        def right(path: Path, blocks: tuple[int, ...]) -> bool:
            got = path.read_bytes()
            return all(got[b * block : (b + 1) * block] == data[b * block : (b + 1) * block] for b in blocks)

        for b in (3, 0, 9, 15, 7):  # each into the one copy, beside the blocks fetched before
            path = src.file_blocks(1, "f.erm", entry, [(b * block + 1, 2)])
            assert path is not None and right(path, (b,))
        assert right(path, (3, 0, 9, 15, 7))
        # the manifest too, once, on the same connection
        assert src.manifest_bytes(1) == src.manifest_bytes(1) == (step_dir / MANIFEST).read_bytes()
        assert server.accepted == 1
        # the peer lost the file: the blocks asked for are not had (nor counted as held), and the ones
        # held stay right
        (step_dir / "f.erm").rename(tmp_path / "f.erm")
        assert src.file_blocks(1, "f.erm", entry, [(11 * block, 1)]) is None
        (tmp_path / "f.erm").rename(step_dir / "f.erm")
        path = src.file_blocks(1, "f.erm", entry, [(11 * block, 1)])
        assert path is not None and right(path, (3, 0, 9, 15, 7, 11))
        assert server.accepted == 2  # a refusal's answer closed the kept connection
        src.clear()
        assert src.file_blocks(1, "f.erm", entry, [(0, 1)]) is not None
        assert server.accepted == 3
        src.clear()
    finally:
        http_thread.stop(5.0)
