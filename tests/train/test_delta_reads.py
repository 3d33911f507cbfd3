"""A restoring rank reads only the parts of a delta file it applies: the header and the entries that
overlap its shards (the checksum blocks covering them, verified), fetched from a peer's checkpoint server
(a real server process on loopback) with range requests. The bytes received are counted."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_delta_sources import delta_fields
from test_timeline_units import ListedOnly

from elastic_rm.checkpoint import restore
from elastic_rm.checkpoint.chain import delta_files
from elastic_rm.checkpoint.delta_file import DeltaPiece, DeltaReader, checksum_block, write_delta
from elastic_rm.checkpoint.local_servers import node_servers
from elastic_rm.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    step_dirname,
)
from elastic_rm.checkpoint.peers import PeerEndpoint
from elastic_rm.checkpoint.restore import DeltaFetch
from elastic_rm.checkpoint.sources import DirectorySource, HttpPeerSource

ROWS, DIM = 40000, 32


def rows_of(table: str, rank: int, gen: torch.Generator) -> DeltaPiece:
    """Touched rows of the half of `table` that `rank` held (row-wise: rank r holds rows r*ROWS/2...)."""
    lo = rank * ROWS // 2
    rows = torch.randperm(ROWS // 2, generator=gen)[: ROWS // 5].sort().values + lo
    values = torch.randn(len(rows), DIM, generator=gen)
    return DeltaPiece(["model", table], [lo, 0], values, rows, [ROWS // 2, DIM])


def write_step(node_dir: Path, step: int, files: dict[str, list[DeltaPiece]], fields: dict[str, Any]) -> dict:
    d = node_dir / step_dirname(step)
    d.mkdir(parents=True)
    entries = {}
    for name, pieces in files.items():
        size = write_delta(d / name, pieces)
        entries[name] = file_entry(d / name, checksum_block(size), node="n0", rank=int(name[2]))
    body = make_manifest(
        {"step": step, "world_size": 2, "nodes": ["n0", "n0"], "position": {}, "files": entries} | fields
    )
    (d / MANIFEST).write_bytes(body)
    return json.loads(body)


def saved_pieces(c: dict[str, Any], wanted) -> list[DeltaPiece]:
    """What the ranks saved of the entries `wanted` takes, in file order."""
    return [
        p for name in sorted(c["files"]) for p in c["files"][name] if wanted(p.key, p.offsets, p.extent or [])
    ]


def write_base(node_dir: Path, step: int) -> dict:
    """A full step of one stand-in file (its bytes are never loaded here)."""
    d = node_dir / step_dirname(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"base")
    files = {"__0_0.distcp": file_entry(d / "__0_0.distcp", node="n0", rank=0)}
    body = make_manifest(
        {"step": step, "world_size": 2, "nodes": ["n0", "n0"], "position": {}, "files": files}
    )
    (d / MANIFEST).write_bytes(body)
    return json.loads(body)


@pytest.fixture
def delta_chain(tmp_path: Path) -> dict[str, Any]:
    """A base (a stand-in file) and a delta saved by two ranks: rank 0's file holds its halves of
    tables t0 and t1 and a dense tensor, rank 1's the other halves."""
    gen = torch.Generator().manual_seed(3)
    node = tmp_path / "shm" / "n0"
    bm = write_base(node, 1)
    dense = DeltaPiece(["model", "dense"], [0], torch.randn(1000, generator=gen))
    files = {
        "__0_delta.erm": [rows_of("t0", 0, gen), rows_of("t1", 0, gen), dense],
        "__1_delta.erm": [rows_of("t0", 1, gen), rows_of("t1", 1, gen)],
    }
    m2 = write_step(node, 2, files, delta_fields(bm, bm))
    return {"root": tmp_path / "shm", "chain": [bm, m2], "files": files, "tmp": tmp_path}


def test_a_rank_fetches_the_rows_of_its_shards_not_every_delta_file(delta_chain) -> None:
    """A rank of a new world that holds table t1's rows 25000..29999 and the dense tensor: it receives
    the headers and the blocks of those entries (rank 1's piece of t1, rank 0's dense tensor), about a
    quarter of what downloading every delta file whole took."""

    def wanted(key: list[str], offsets: list[int], extent: list[int]) -> bool:
        if key == ["model", "dense"]:
            return True
        return key == ["model", "t1"] and offsets[0] < 30000 and offsets[0] + extent[0] > 25000

    c = delta_chain
    with node_servers(c["root"], ["n0"]) as s:
        peer = PeerEndpoint("n0", s["n0"].url, s["n0"].token)
        whole = HttpPeerSource(peer, c["tmp"] / "fetch-whole")
        before = delta_files(c["chain"], [whole])
        ranged = HttpPeerSource(peer, c["tmp"] / "fetch-ranged")
        after = delta_files(c["chain"], [ranged], wanted=wanted)
    sizes = sum(e["size"] for e in c["chain"][1]["files"].values())
    assert whole.bytes_fetched == sizes  # every file, whole: what each rank received before
    assert 0 < ranged.bytes_fetched < 0.3 * sizes, (ranged.bytes_fetched, sizes)
    # what the rank applies is read from the partial copies, equal to what was saved
    read = [p for path in after[0][1] for p in DeltaReader(path).pieces(wanted)]
    saved = saved_pieces(c, wanted)
    assert len(read) == len(saved) == 2
    for got, exp in zip(read, saved, strict=True):
        assert got.key == exp.key and torch.equal(got.values, exp.values)
        assert (got.rows is None) == (exp.rows is None) and (
            got.rows is None or torch.equal(got.rows, exp.rows)
        )
    assert [sorted(used.values()) for _, _, used in before] == [["peer:n0", "peer:n0"]]


def test_a_corrupt_block_of_an_entry_a_rank_reads_is_refused(delta_chain) -> None:
    c = delta_chain
    path = c["root"] / "n0" / step_dirname(2) / "__1_delta.erm"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside rank 1's last entry (t1's rows)
    path.write_bytes(bytes(data))
    with node_servers(c["root"], ["n0"]) as s:
        src = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), c["tmp"] / "fetch")
        with pytest.raises(CorruptCheckpointError, match="__1_delta.erm.*checksum mismatch in block"):
            delta_files(c["chain"], [src], wanted=lambda key, off, ext: key == ["model", "t1"])
        # a rank that does not read that entry is not stopped by it
        delta_files(c["chain"], [src], wanted=lambda key, off, ext: key == ["model", "dense"])


def assert_read_as_saved(files, c: dict[str, Any], wanted) -> None:
    read = [p for path in files[0][1] for p in DeltaReader(path).pieces(wanted)]
    saved = saved_pieces(c, wanted)
    assert len(read) == len(saved) > 0
    for got, exp in zip(read, saved, strict=True):
        assert got.key == exp.key and torch.equal(got.values, exp.values)


def test_a_chains_delta_files_are_read_on_a_thread_through_forks_of_the_peer_sources(delta_chain) -> None:
    """While the base loads, a thread reads the delta files through a fork of each peer source (a
    connection and a cache of its own); what it fetched counts on the source it was forked from, and
    closing the fetch drops the fork's copies. A refused file is raised on the restoring thread."""
    c = delta_chain
    wanted = lambda key, off, ext: key == ["model", "t1"]  # noqa: E731
    with node_servers(c["root"], ["n0"]) as s:
        peer = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), c["tmp"] / "fetch")
        fetch = DeltaFetch(c["chain"], [peer], True, wanted)
        files = fetch.result()
        assert fetch.took_s > 0 and files[0][0] == 2
        assert all((c["tmp"] / "fetch" / "deltas") in path.parents for path in files[0][1])
        assert_read_as_saved(files, c, wanted)
        assert peer.bytes_fetched == 0  # counted once the fork is done with
        fetch.close()
        assert peer.bytes_fetched > 0 and not (c["tmp"] / "fetch" / "deltas").exists()
        peer.clear()

        path = c["root"] / "n0" / step_dirname(2) / "__1_delta.erm"
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # inside rank 1's last entry (t1's rows)
        path.write_bytes(bytes(data))
        fetch = DeltaFetch(c["chain"], [peer], True, wanted)
        with pytest.raises(CorruptCheckpointError, match="__1_delta.erm.*checksum mismatch in block"):
            fetch.result()
        fetch.close()
        peer.clear()


def test_a_source_without_fork_is_read_before_the_base(delta_chain) -> None:
    c = delta_chain
    wanted = lambda key, off, ext: key == ["model", "dense"]  # noqa: E731
    fetch = DeltaFetch(c["chain"], [ListedOnly(c["root"] / "n0")], True, wanted)
    assert not fetch.on_thread and fetch.took_s > 0  # read already, on this thread
    assert_read_as_saved(fetch.result(), c, wanted)
    fetch.close()
    # a directory source forks as itself: read on the thread, and never cleared
    own = DirectorySource("n0", c["root"] / "n0")
    assert own.fork("deltas") is own
    fetch = DeltaFetch(c["chain"], [own], True, wanted)
    assert_read_as_saved(fetch.result(), c, wanted)
    fetch.close()
    assert (c["root"] / "n0" / step_dirname(2) / "__0_delta.erm").is_file()


def world_of_one(monkeypatch, fail_at: int | None = None) -> None:
    """restore_checkpoint's gathers as in a world of one, the `fail_at`-th raising as when a member dies
    in the middle of the restore; no model here: the state to load is empty."""
    calls = [0]

    def gather(obj, pg=None):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("a member died (connection closed by peer)")
        return [obj]

    monkeypatch.setattr(restore, "all_gather_json", gather)
    monkeypatch.setattr(restore, "app_state", lambda dmp, opt: {})
    monkeypatch.setattr(restore, "load_app_state", lambda *args: None)


def test_a_gather_that_fails_while_the_delta_files_are_read_leaves_no_thread_and_no_copies(
    delta_chain, monkeypatch
) -> None:
    c = delta_chain
    world_of_one(monkeypatch, fail_at=3)  # the steps, the manifest's digest, then the chain's outcome
    with node_servers(c["root"], ["n0"]) as s:
        peer = HttpPeerSource(PeerEndpoint("n0", s["n0"].url, s["n0"].token), c["tmp"] / "fetch")
        with pytest.raises(RuntimeError, match="a member died"):
            restore.restore_checkpoint(None, None, [peer], None, 0)
        assert not [t for t in threading.enumerate() if t.name == "elastic-rm-restore-deltas"]
        assert not (c["tmp"] / "fetch" / "deltas").exists()
        assert peer.bytes_fetched > 0  # the fork's, counted when it was cleared
        peer.clear()


def test_a_chain_refused_over_its_delta_files_costs_one_base_load(tmp_path: Path, monkeypatch) -> None:
    """Base 1, deltas 2, 3 and 4; delta 2's file is lost. Step 4's files are read while its base loads
    and refused after it; the older chains (which share delta 2) are then read before their base and
    refused without loading it, and step 1 is loaded: two loads, not one per step."""
    node = tmp_path / "n0"
    parent = base = write_base(node, 1)
    for step in (2, 3, 4):
        piece = DeltaPiece(["model", "x"], [0], torch.randn(100))
        parent = write_step(node, step, {"__0_delta.erm": [piece]}, delta_fields(parent, base))
    (node / step_dirname(2) / "__0_delta.erm").unlink()
    world_of_one(monkeypatch)
    loads: list[int] = []
    monkeypatch.setattr(
        restore.dcp,
        "load",
        lambda state, storage_reader, process_group: loads.append(storage_reader.resolver.step),
    )
    # as rank 1: rank 0 logs the world size, from a process group this test has not
    got = restore.restore_checkpoint(None, None, [DirectorySource("n0", node)], None, 1)
    assert got is not None and got.step == 1 and len(got.skipped) == 3, got
    assert all("__0_delta.erm" in why for why in got.skipped), got.skipped
    assert loads == [1, 1]


def test_reads_ended_by_any_exception_are_never_taken_for_an_empty_chain(delta_chain, monkeypatch) -> None:
    """A SystemExit in the reading thread ends that thread quietly: the restoring thread must get it,
    not a chain of no delta files (its base alone, named as the delta step)."""

    def exits(*args, **kwargs):
        raise SystemExit(3)

    monkeypatch.setattr(restore, "delta_files", exits)
    c = delta_chain
    fetch = DeltaFetch(c["chain"], [DirectorySource("n0", c["root"] / "n0")], True, lambda *a: True)
    assert fetch.on_thread
    with pytest.raises(SystemExit):
        fetch.result()
    fetch.close()
