"""Delta checkpoint pieces without a world: the file format, applying rows into shards of another
layout, the manifest's chain fields, and the chain-aware prune."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elastic_rm.checkpoint.chain import apply_delta
from elastic_rm.checkpoint.delta_file import (
    DeltaPiece,
    DeltaReader,
    checksum_block,
    write_delta,
    write_delta_entry,
)
from elastic_rm.checkpoint.flash import FlashConfig
from elastic_rm.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    parse_manifest,
    prune_steps,
    step_dirname,
)


def test_delta_file_round_trips_every_dtype_and_shape(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    pieces = [
        DeltaPiece(["model", "t.weight"], [4, 8], torch.randn(3, 8, generator=g), torch.tensor([4, 9, 11])),
        DeltaPiece(
            ["optim", "t.weight", "t.momentum1"], [96], torch.rand(2, generator=g), torch.tensor([97, 120])
        ),
        DeltaPiece(["model", "half"], [0, 0], torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        DeltaPiece(["dense_optim", "w", "step"], [], torch.tensor(7.0)),
        DeltaPiece(["model", "empty"], [0, 0], torch.empty(0, 16), torch.empty(0, dtype=torch.int64)),
    ]
    size = write_delta(tmp_path / "d.erm", pieces)
    assert size == (tmp_path / "d.erm").stat().st_size
    back = DeltaReader(tmp_path / "d.erm").pieces()
    assert len(back) == len(pieces)
    for a, b in zip(pieces, back, strict=True):
        assert a.key == b.key and a.offsets == b.offsets
        assert a.values.dtype == b.values.dtype and torch.equal(a.values, b.values)
        assert (a.rows is None) == (b.rows is None)
        if a.rows is not None:
            assert torch.equal(a.rows, b.rows)
    only = DeltaReader(tmp_path / "d.erm").pieces(lambda key, off, extent: key[0] == "optim")
    assert [p.key for p in only] == [pieces[1].key]


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: b"NOTDELTA" + raw[8:],
        lambda raw: raw[:20],
        lambda raw: raw[:16] + b"[" + raw[17:],
        lambda raw: raw[:-60],  # the row ids run past the end
    ],
)
def test_a_damaged_delta_file_is_refused_naming_it(tmp_path: Path, damage) -> None:
    path = tmp_path / "__0_delta.erm"
    write_delta(path, [DeltaPiece(["model", "w"], [0, 0], torch.ones(2, 4), torch.tensor([0, 5]))])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptCheckpointError, match="__0_delta.erm: not a valid delta checkpoint file"):
        DeltaReader(path).pieces()


def test_rows_land_in_the_shards_of_another_layout() -> None:
    """Rows saved from a row-wise shard and a column block are written into a table-wise copy and
    into a new row split, element for element; other rows are left alone."""
    full = torch.arange(10 * 8, dtype=torch.float32).reshape(10, 8)
    rows = torch.tensor([1, 6, 9])
    saved = [
        DeltaPiece(["model", "t"], [5, 0], full[5:10, 0:4][rows[rows >= 5] - 5], rows[rows >= 5]),
        DeltaPiece(["model", "t"], [0, 0], full[0:5, 0:4][rows[rows < 5]], rows[rows < 5]),
        DeltaPiece(["model", "t"], [0, 4], full[:, 4:8][rows], rows),
    ]
    whole = torch.zeros(10, 8)
    apply_delta({"model": {"t": whole}}, saved)
    want = torch.zeros(10, 8)
    want[rows] = full[rows]
    assert torch.equal(whole, want)
    # a 1-D state of a column-wise table: one block of rows per column shard (2 shards of 10 rows)
    momentum = torch.zeros(20)
    ids = torch.tensor([1, 9, 11, 19])
    apply_delta(
        {"optim": {"m": momentum}}, [DeltaPiece(["optim", "m"], [0], torch.tensor([1.0, 2, 3, 4]), ids)]
    )
    assert momentum[ids].tolist() == [1.0, 2, 3, 4] and float(momentum.sum()) == 10.0


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_rows_read_from_a_file_land_in_every_shard_they_fall_into(tmp_path: Path, order: str) -> None:
    """A delta file's rows (as take_delta writes them, sorted; or in any order) go into the row
    shards of a new split, each shard taking its rows and leaving the others; writing to a piece read
    back changes neither the file nor a second read of it."""
    full = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4) + 1
    rows = torch.tensor([0, 3, 4, 7, 8, 11])
    if order == "unsorted":
        rows = rows[torch.tensor([3, 0, 5, 1, 4, 2])]
    path = tmp_path / "d.erm"
    write_delta(path, [DeltaPiece(["model", "t"], [0, 0], full[rows], rows, [12, 4])])
    before = path.read_bytes()
    shards = [torch.zeros(5, 4), torch.zeros(4, 4), torch.zeros(3, 4)]  # rows 0-4, 5-8, 9-11
    for start, shard in zip([0, 5, 9], shards, strict=True):
        read = DeltaReader(path).pieces()[0]
        assert read.rows is not None
        # the state holds one shard, at offset 0: row ids shifted by its first global row
        apply_delta(
            {"model": {"t": shard}}, [DeltaPiece(["model", "t"], [0, 0], read.values, read.rows - start)]
        )
    got = torch.cat(shards)
    want = torch.zeros(12, 4)
    want[rows] = full[rows]
    assert torch.equal(got, want)
    piece = DeltaReader(path).pieces()[0]
    piece.values.fill_(-1.0)
    assert path.read_bytes() == before
    assert torch.equal(DeltaReader(path).pieces()[0].values, full[rows])


def _step(
    root: Path, step: int, kind: str = "full", parent: int | None = None, base: int | None = None
) -> None:
    d = root / step_dirname(step)
    d.mkdir(parents=True)
    body: dict = {"step": step, "world_size": 1, "position": {}, "files": {}, "kind": kind}
    if kind == "delta":
        body.update(parent=parent, base=base, parent_sha256="x", base_sha256="y")
    (d / MANIFEST).write_bytes(make_manifest(body))


def test_prune_keeps_the_whole_chain_of_the_kept_steps(tmp_path: Path) -> None:
    _step(tmp_path, 1)
    _step(tmp_path, 2, "delta", 1, 1)
    _step(tmp_path, 3)
    for s in (4, 5, 6):
        _step(tmp_path, s, "delta", s - 1, 3)
    prune_steps(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dirname(s) for s in (3, 4, 5, 6)]
    _step(tmp_path, 7)
    prune_steps(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dirname(7)]
    shutil.rmtree(tmp_path / step_dirname(7))


@pytest.mark.parametrize("field", ["keep_memory", "keep_durable"])
def test_keeping_no_step_is_refused_since_the_prune_would_remove_the_newest(field: str) -> None:
    with pytest.raises(ValueError, match=f"FlashConfig.{field} must be >= 1"):
        FlashConfig(run_id="r", node_id="n", peers=None, **{field: 0})
    assert getattr(FlashConfig(run_id="r", node_id="n", peers=None, **{field: 1}), field) == 1


def test_manifest_chain_fields_are_checked() -> None:
    body = {"step": 5, "world_size": 2, "position": {}, "files": {}, "kind": "delta"}
    good = {**body, "parent": 4, "base": 2, "parent_sha256": "a", "base_sha256": "b"}
    assert parse_manifest(make_manifest(good), "t")["parent"] == 4
    for bad, match in [
        ({**good, "kind": "partial"}, "'kind' must be"),
        ({**good, "parent": 5}, "'parent' must be an earlier step"),
        ({**good, "base": None}, "'base' must be an earlier step"),
        ({k: v for k, v in good.items() if k != "parent_sha256"}, "needs 'parent_sha256'"),
        ({**good, "base": 4, "parent": 3}, "base must not come after its parent"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=match):
            parse_manifest(make_manifest(bad), "t")
    assert json.loads(make_manifest({**body, "kind": "full"}))["kind"] == "full"


def test_write_delta_entry_is_the_entry_of_the_file_written(tmp_path):
    """The entry a save puts in its manifest, hashed from the bytes in memory, is the one the file on
    disk has: what a reader verifies and what a peer checks on receipt."""
    rows = torch.tensor([1, 4, 7, 9000])
    pieces = [
        DeltaPiece(["model", "t"], [0, 0], torch.randn(4, 64), rows, [9001, 64]),
        DeltaPiece(["optim", "t", "momentum"], [0], torch.randn(4), rows, [9001]),
        DeltaPiece(["model", "dense"], [0], torch.randn(300_000)),  # more than one checksum block
    ]
    path = tmp_path / "d.erm"
    entry = write_delta_entry(path, pieces)
    size = path.stat().st_size
    assert len(entry["blocks"]) > 1
    assert entry == file_entry(path, checksum_block(size))
    assert write_delta(tmp_path / "again.erm", pieces) == size
    assert (tmp_path / "again.erm").read_bytes() == path.read_bytes()
