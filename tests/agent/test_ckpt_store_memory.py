"""A replica upload must not leave its blocks on the agent's heap (elastic_rm.checkpoint.store).

Each upload runs on a request thread of its own; a block allocated from the Python heap per read lands
in that thread's glibc arena and stays there after the upload (benchmarks/recovery/memory measured an
agent growing at every round a node joined). The store reads into a mapping of its own instead."""

from __future__ import annotations

import io
import os
import tracemalloc

import pytest

from elastic_rm.checkpoint import store as store_module
from elastic_rm.checkpoint.manifest import FILE_HASH, file_entry, make_manifest, new_hasher, step_dirname
from elastic_rm.checkpoint.store import CHUNK, CheckpointStore, Refused


def test_an_upload_of_many_blocks_allocates_no_block_on_the_python_heap(tmp_path):
    store = CheckpointStore(tmp_path / "n0")
    data = os.urandom(3 * CHUNK + 12345)  # three whole blocks and a partial one
    store.begin("n1", 10)
    rfile = io.BufferedReader(io.BytesIO(data))
    tracemalloc.start()
    try:
        store.receive("n1", 10, "shard.bin", len(data), rfile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < CHUNK // 4, f"an upload's reads peaked at {peak} bytes on the Python heap"
    written = (tmp_path / "n0" / "replicas" / "n1" / (step_dirname(10) + ".tmp") / "shard.bin").read_bytes()
    assert written == data
    h = new_hasher(FILE_HASH)
    h.update(data)
    assert store._pending[("n1", 10)]["shard.bin"] == (len(data), h.hexdigest())


def test_a_cut_upload_is_refused_and_leaves_no_part_file(tmp_path):
    store = CheckpointStore(tmp_path / "n0")
    store.begin("n1", 10)
    data = os.urandom(CHUNK + 7)
    try:
        store.receive("n1", 10, "shard.bin", len(data) + 100, io.BufferedReader(io.BytesIO(data)))
    except Exception as exc:  # noqa: BLE001 - the Refused below
        assert getattr(exc, "code", None) == 400 and "connection cut" in str(exc)
    else:
        raise AssertionError("a short upload must be refused")
    assert list((tmp_path / "n0" / "replicas" / "n1" / (step_dirname(10) + ".tmp")).iterdir()) == []


def test_uploads_one_after_another_reuse_one_mapped_buffer(tmp_path):
    """A mapping per upload made the final checkpoint's replica uploads slow (the swap's drain): uploads
    that do not overlap take the same pooled buffer again."""
    from elastic_rm.checkpoint import store as ckpt_store

    store = CheckpointStore(tmp_path / "n0")
    store.begin("n1", 10)
    for name in ("a.bin", "b.bin", "c.bin"):
        data = os.urandom(CHUNK // 2)
        store.receive("n1", 10, name, len(data), io.BufferedReader(io.BytesIO(data)))
        pooled = list(ckpt_store._POOL)
        assert len(pooled) >= 1
        if name == "a.bin":
            first = pooled[-1]
        else:
            assert pooled[-1] is first, "a new mapping was made for an upload that did not overlap another"
    assert len(ckpt_store._POOL) <= ckpt_store.POOLED_BUFFERS


def test_a_commit_sent_again_after_it_went_through_succeeds_and_another_is_refused(tmp_path):
    store = CheckpointStore(tmp_path / "n0")
    data = os.urandom(1000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "shard.bin").write_bytes(data)
    entry = file_entry(src / "shard.bin", node="n1", rank=1)

    def manifest(position: int) -> bytes:
        return make_manifest(
            {"step": 10, "world_size": 2, "nodes": ["n0", "n1"], "position": {"step": position}}
            | {"files": {"shard.bin": entry}}
        )

    store.begin("n1", 10)
    store.receive("n1", 10, "shard.bin", len(data), io.BufferedReader(io.BytesIO(data)))
    store.commit("n1", 10, manifest(10), keep=2)
    store.commit("n1", 10, manifest(10), keep=2)  # its answer was lost: the pusher sends it again
    with pytest.raises(Refused) as refused:
        store.commit("n1", 10, manifest(11), keep=2)
    assert refused.value.code == 409


def test_a_commit_samples_the_memory_held_without_holding_the_lock(tmp_path, monkeypatch):
    """The sample walks the node directory; uploads from other nodes must not wait for the walk."""
    store = CheckpointStore(tmp_path / "n0")
    real, locked = store_module.held_bytes, []

    def held_bytes(root):
        locked.append(store._lock.locked())
        return real(root)

    monkeypatch.setattr(store_module, "held_bytes", held_bytes)
    data = os.urandom(1000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "shard.bin").write_bytes(data)
    entry = file_entry(src / "shard.bin", node="n1", rank=1)
    body = make_manifest(
        {"step": 10, "world_size": 2, "nodes": ["n0", "n1"], "position": {"step": 10}}
        | {"files": {"shard.bin": entry}}
    )
    store.begin("n1", 10)
    store.receive("n1", 10, "shard.bin", len(data), io.BufferedReader(io.BytesIO(data)))
    store.commit("n1", 10, body, keep=2)
    assert locked and not any(locked), "the node directory was walked under the store's lock"
    assert store.listing()["peak_bytes"] >= len(data)
