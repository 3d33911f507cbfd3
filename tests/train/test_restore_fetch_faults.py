"""Faults on a restore's reads from its sources: a peer's listing that is not what a checkpoint server
sends, a manifest whose block checksums do not cover its file, and a peer that was down during one
restore and is back for the next one through the same sources (restore(sources=...) twice in one
process). Each must end as an error or a warning naming what failed, never as a crash of the restore
(a TypeError from the network's bytes) or a quiet choice."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from elastic_rm.checkpoint.manifest import (
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    parse_manifest,
    step_dirname,
)
from elastic_rm.checkpoint.peers import PeerEndpoint
from elastic_rm.checkpoint.sources import (
    DirectorySource,
    FileResolver,
    HttpPeerSource,
    SourceUnavailable,
    newest_timeline_of,
)


@contextmanager
def answering(body: bytes, port: int = 0) -> Iterator[str]:
    """A stand-in for a peer's checkpoint server that answers every GET with `body` (200, JSON)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


@pytest.mark.parametrize(
    "body",
    [
        b"<html>not json</html>",
        b"[3, 4]",
        b'{"steps": 4}',
        b'{"steps": [[4]]}',
        b'{"steps": [4], "replicas": [5]}',
        b'{"steps": [4], "replicas": {"n1": 5}}',
        b'{"steps": [4], "timeline": {"id": "2", "from": []}}',
        b'{"steps": [4], "timeline": 7}',
    ],
)
def test_a_malformed_peer_listing_is_a_warning_naming_the_peer_not_a_crash(
    body: bytes, tmp_path: Path, caplog
) -> None:
    """The listing is the first thing a restore reads from a peer (its steps, and its newest timeline for
    the vote): a body of another shape crashed the restore (JSONDecodeError, TypeError, AttributeError),
    and a malformed timeline was dropped quietly, leaving the peer's steps in a vote that ignored its
    timeline. Now the peer is skipped for that restore, with a warning that names it and what is wrong."""
    with answering(body) as url:
        src = HttpPeerSource(PeerEndpoint("n7", url, "token"), tmp_path / "cache", timeout_s=10)
        assert newest_timeline_of([src]) is None
        assert src.steps() == []
        assert src.down is not None and "malformed step listing" in src.down
        assert any("peer:n7" in r.getMessage() and "malformed" in r.getMessage() for r in caplog.records)
        src.clear()


def test_a_sound_peer_listing_still_reads(tmp_path: Path) -> None:
    doc = {"steps": [4], "replicas": {"n1": [5, 3]}, "timeline": {"id": 1, "from": [[0, 3]]}}
    with answering(json.dumps(doc).encode()) as url:
        src = HttpPeerSource(PeerEndpoint("n7", url, "token"), tmp_path / "cache", timeout_s=10)
        assert src.steps() == [3, 4, 5] and newest_timeline_of([src]) == (1, ((0, 3),))
        src.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_down_at_one_restore_is_read_again_at_the_next(tmp_path: Path) -> None:
    """A connection failure skips a peer for the rest of *that* restore (docs/train.md, "Sources"). A
    source list passed to two restores in a row kept the peer down after clear(): the second restore
    never asked the peer, back by then, and lost its steps."""
    port = free_port()
    src = HttpPeerSource(PeerEndpoint("n7", f"http://127.0.0.1:{port}", "token"), tmp_path / "c", 10)
    assert src.steps() == [] and src.down is not None  # nothing listens yet
    src.clear()  # the end of the first restore
    with answering(b'{"steps": [6]}', port):
        assert src.steps() == [6]
        src.clear()


def test_a_fork_that_found_the_peer_down_tells_the_source_it_was_forked_from(tmp_path: Path) -> None:
    """The delta files of a chain are read through a fork; when the peer dies under the fork, the base
    and the older chains tried after it must not wait on the peer again (one timeout per restore, not
    one per step tried). The source counts as up again once the restore clears it."""
    port = free_port()
    src = HttpPeerSource(PeerEndpoint("n7", f"http://127.0.0.1:{port}", "token"), tmp_path / "c", 10)
    src._listed = ([2], None)  # listed before the peer died
    fork = src.fork("deltas")
    entry = {"size": 10, "block": 4, "blocks": ["a", "b", "c"], "xxh3_128": "x"}
    with pytest.raises(SourceUnavailable):
        fork.file_blocks(2, "__0_delta.erm", entry, [(0, 4)])
    assert fork.down is not None and src.down is None
    fork.clear()
    assert src.down is not None and src.steps() == []
    src.clear()
    assert src.down is None


def test_block_checksums_that_do_not_cover_the_file_make_the_manifest_malformed(tmp_path: Path) -> None:
    """A manifest passes its own checksum whoever wrote it; with fewer block checksums than its file has
    blocks, a reader of the last block ended the restore in an IndexError that named no file."""
    d = tmp_path / step_dirname(1)
    d.mkdir()
    (d / "f.bin").write_bytes(b"x" * 300_000)
    entry = file_entry(d / "f.bin", 65536)
    short = dict(entry, blocks=entry["blocks"][:2])
    body = make_manifest({"step": 1, "world_size": 1, "position": {}, "files": {"f.bin": short}})
    with pytest.raises(CorruptCheckpointError, match="'f.bin'.*2 block checksums for 300000 bytes"):
        parse_manifest(body, "here")
    # a sound manifest, and a read past the end of its file (a .metadata of another file): refused,
    # naming the file, not an IndexError
    body = make_manifest({"step": 1, "world_size": 1, "position": {}, "files": {"f.bin": entry}})
    resolver = FileResolver(1, parse_manifest(body, "here"), [DirectorySource("d", tmp_path)])
    with pytest.raises(CorruptCheckpointError, match="no good copy of f.bin .*block 6 of a file of 5"):
        resolver.path("f.bin", [(400_000, 8)])
    assert resolver.path("f.bin", [(200_000, 8)]) == d / "f.bin"


def test_a_read_of_no_bytes_at_the_end_of_a_file_needs_no_block(tmp_path: Path) -> None:
    """An empty tensor may lie at the very end of a file whose size is a whole number of blocks: its
    range names no byte, so no block checksum is looked up for it (there is none)."""
    d = tmp_path / step_dirname(1)
    d.mkdir()
    (d / "f.bin").write_bytes(b"x" * 131072)
    entry = file_entry(d / "f.bin", 65536)
    body = make_manifest({"step": 1, "world_size": 1, "position": {}, "files": {"f.bin": entry}})
    resolver = FileResolver(1, parse_manifest(body, "here"), [DirectorySource("d", tmp_path)])
    assert resolver.path("f.bin", [(0, 8), (131072, 0)]) == d / "f.bin"


def test_a_delta_whose_last_entry_is_empty_is_read(tmp_path: Path) -> None:
    """Every tensor of a delta file is padded to 64 bytes, so a file of 4 MiB or more is exactly its 64
    checksum blocks; an entry of no rows (a shard none of whose rows the step looked up) at the end lies
    at the file's end, in block 64, which does not exist. Reading it refused the whole delta step with
    an IndexError (the restore fell back to an older step)."""
    import torch

    from elastic_rm.checkpoint.chain import delta_files
    from elastic_rm.checkpoint.delta_file import DeltaPiece, DeltaReader, checksum_block, write_delta
    from elastic_rm.checkpoint.manifest import MANIFEST
    from tests.train.test_delta_reads import write_base
    from tests.train.test_delta_sources import delta_fields

    node = tmp_path / "n0"
    base = write_base(node, 1)
    full = DeltaPiece(["model", "t0"], [0, 0], torch.randn(40_000, 32), torch.arange(40_000), [40_000, 32])
    empty = DeltaPiece(
        ["model", "t1"], [0, 0], torch.empty(0, 32), torch.empty(0, dtype=torch.int64), [100, 32]
    )
    d = node / step_dirname(2)
    d.mkdir()
    size = write_delta(d / "__0_delta.erm", [full, empty])
    assert size >= 4 << 20 and size % 64 == 0
    entry = file_entry(d / "__0_delta.erm", checksum_block(size), node="n0", rank=0)
    assert len(entry["blocks"]) * entry["block"] == size  # whole blocks: the file ends at a boundary
    body = make_manifest(
        {"step": 2, "world_size": 1, "nodes": ["n0"], "position": {}, "files": {"__0_delta.erm": entry}}
        | delta_fields(base, base)
    )
    (d / MANIFEST).write_bytes(body)
    chain = [base, parse_manifest(body, "here")]
    wanted = lambda key, off, ext: key == ["model", "t1"]  # noqa: E731
    files = delta_files(chain, [DirectorySource("n0", node)], True, wanted)
    (got,) = DeltaReader(files[0][1][0]).pieces(wanted)
    assert got.key == ["model", "t1"] and got.values.shape == (0, 32)
    # and from a peer, which sends the header's blocks only
    from elastic_rm.checkpoint.local_servers import node_servers

    with node_servers(tmp_path, ["n0"]) as s:
        peer = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), tmp_path / "fetch", 60)
        try:
            files = delta_files(chain, [peer], True, wanted)
            (got,) = DeltaReader(files[0][1][0]).pieces(wanted)
            assert got.values.shape == (0, 32) and 0 < peer.bytes_fetched < size // 8
        finally:
            peer.clear()
