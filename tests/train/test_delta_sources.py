"""A delta's chain read from sources that disagree: two copies of the same step that are different
checkpoints (another run's step, a replaced one). Every link is taken from a source whose manifest is
the one its child names, and every file from a source holding that same manifest: the right chain is
chosen, or the step is refused; a chain is never mixed from two checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from elastic_rm.checkpoint.chain import chain_of, delta_files
from elastic_rm.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    step_dirname,
)
from elastic_rm.checkpoint.retention import drop_newer_than
from elastic_rm.checkpoint.sources import DirectorySource, FileResolver, memory_sources
from elastic_rm.checkpoint.store import CheckpointStore


def write_step(root: Path, step: int, files: dict[str, bytes], fields: dict[str, Any]) -> dict[str, Any]:
    d = root / step_dirname(step)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    entries = {n: file_entry(d / n, node="n0", rank=0) for n in files}
    body = make_manifest(
        {"step": step, "world_size": 1, "nodes": ["n0"], "position": {"step": step}, "files": entries}
        | fields
    )
    (d / MANIFEST).write_bytes(body)
    return json.loads(body)


def delta_fields(parent: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "delta",
        "parent": parent["step"],
        "parent_sha256": parent["manifest_sha256"],
        "base": base["step"],
        "base_sha256": base["manifest_sha256"],
    }


@pytest.fixture
def disagreeing(tmp_path: Path) -> dict[str, Any]:
    """Source "a" (first) holds another run's steps 1 and 2, files of the same names and sizes;
    source "b" holds this run's chain 1 (base), 2, 3 (deltas); "a" also holds this run's step 3."""
    a, b = tmp_path / "a", tmp_path / "b"
    size = 4096
    other1 = write_step(a, 1, {"__0_0.distcp": os.urandom(size)}, {"kind": "full"})
    write_step(a, 2, {"__0_delta.erm": os.urandom(size)}, delta_fields(other1, other1))
    base = write_step(b, 1, {"__0_0.distcp": os.urandom(size)}, {"kind": "full"})
    m2 = write_step(b, 2, {"__0_delta.erm": os.urandom(size)}, delta_fields(base, base))
    m3 = write_step(b, 3, {"__0_delta.erm": os.urandom(size)}, delta_fields(m2, base))
    (a / step_dirname(3)).mkdir()
    for p in (b / step_dirname(3)).iterdir():
        (a / step_dirname(3) / p.name).write_bytes(p.read_bytes())
    return {"a": a, "b": b, "base": base, "m2": m2, "m3": m3}


def test_the_link_named_by_its_child_is_chosen_from_the_source_that_holds_it(disagreeing) -> None:
    d = disagreeing
    sources = [DirectorySource("a", d["a"]), DirectorySource("b", d["b"])]
    chain = chain_of(d["m3"], sources)
    assert [m["manifest_sha256"] for m in chain] == [
        d["base"]["manifest_sha256"],
        d["m2"]["manifest_sha256"],
        d["m3"]["manifest_sha256"],
    ]
    for verify in (True, False):  # without checksums too: a file of the same size from "a" is not read
        deltas = delta_files(chain, sources, verify)
        assert [(step, sorted(set(used.values()))) for step, _, used in deltas] == [(2, ["b"]), (3, ["a"])]
        assert deltas[0][1][0].read_bytes() == (d["b"] / step_dirname(2) / "__0_delta.erm").read_bytes()
        base = FileResolver(1, chain[0], sources, verify)
        assert base.path("__0_0.distcp") == d["b"] / step_dirname(1) / "__0_0.distcp"
        assert base.resolved["__0_0.distcp"][0] == "b"


def test_a_link_no_source_holds_is_refused_naming_the_other_checkpoint(disagreeing) -> None:
    d = disagreeing
    with pytest.raises(CorruptCheckpointError, match="another checkpoint than the one it was built on"):
        chain_of(d["m3"], [DirectorySource("a", d["a"])])
    resolver = FileResolver(2, d["m2"], [DirectorySource("a", d["a"])], verify=False)
    with pytest.raises(CorruptCheckpointError, match="a: holds another checkpoint of step 2"):
        resolver.path("__0_delta.erm")


@pytest.fixture
def node_memory(tmp_path: Path) -> dict[str, Any]:
    """A node's memory after a restore went back: its own step 2 and the replica of peer C hold the new
    checkpoint of step 2 (one manifest; each directory holds its node's file); the replica of peer B
    still holds an old one, with a file of the same name and size as C's."""
    root, size = tmp_path / "n0", 4096
    new = {"__0_0.distcp": os.urandom(size), "__1_0.distcp": os.urandom(size)}
    m = write_step(tmp_path / "whole", 2, new, {"kind": "full"})
    old = {"__0_0.distcp": os.urandom(size), "__1_0.distcp": os.urandom(size)}
    write_step(root / "replicas" / "B", 2, old, {"kind": "full"})
    for directory, file in ((root, "__0_0.distcp"), (root / "replicas" / "C", "__1_0.distcp")):
        d = directory / step_dirname(2)
        d.mkdir(parents=True)
        (d / file).write_bytes(new[file])
        (d / MANIFEST).write_bytes((tmp_path / "whole" / step_dirname(2) / MANIFEST).read_bytes())
    (root / "replicas" / "B" / step_dirname(2) / "__0_0.distcp").unlink()
    return {"root": root, "new": new, "manifest": m}


def test_node_memory_reads_a_file_only_with_its_own_directorys_manifest(node_memory) -> None:
    d = node_memory
    sources = memory_sources("local:n0", d["root"])
    assert [s.name for s in sources] == ["local:n0", "local:n0/replica:B", "local:n0/replica:C"]
    for verify in (True, False):  # without checksums, B's file of the same size must not be read
        resolver = FileResolver(2, d["manifest"], sources, verify)
        assert resolver.path("__1_0.distcp").read_bytes() == d["new"]["__1_0.distcp"]
        assert resolver.resolved["__1_0.distcp"][0] == "local:n0/replica:C"


def test_drop_newer_than_clears_steps_and_unfinished_saves_after_the_restored_one(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_step(tmp_path, step, {"__0_0.distcp": b"x"}, {"kind": "full"})
    (tmp_path / f"{step_dirname(4)}.tmp").mkdir()
    (tmp_path / f"{step_dirname(1)}.tmp").mkdir()
    assert drop_newer_than(tmp_path, 1) == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dirname(1), f"{step_dirname(1)}.tmp"]
    assert drop_newer_than(tmp_path / "absent", 1) == []


def test_a_peer_serves_files_only_of_the_manifest_it_serves(node_memory) -> None:
    d = node_memory
    store = CheckpointStore(d["root"])
    assert json.loads(store.manifest_path(2).read_bytes()) == d["manifest"]
    assert store.file_path(2, "__1_0.distcp").read_bytes() == d["new"]["__1_0.distcp"]
