"""A fold in place stopped at each of its points (an exception, or the process killed) is finished from
its journal, to the same bytes as an uninterrupted fold, and the folded base restores bit for bit;
while it is stopped, no reader finds the half-folded base. Real parts: a chain saved by a real gloo
world with TorchRec tables (base + 3 deltas), folded by the code the checkpointer and the checkpoint
server run; the restore is the checkpointer's (its start finishes the interrupted fold)."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from erm_harness import assemble, assert_bit_exact, run_world

from elastic_rm.checkpoint import inplace
from elastic_rm.checkpoint.inplace import (
    JOURNAL,
    FoldRefused,
    apply_in_place,
    fold_chain,
    folded_manifest,
    hidden_dirname,
    recover_fold,
)
from elastic_rm.checkpoint.manifest import MANIFEST, file_entry, make_manifest
from elastic_rm.checkpoint.node_memory import memory_dirs
from elastic_rm.checkpoint.retention import chain, drop_newer_than, read_links
from elastic_rm.checkpoint.server import CheckpointServer
from elastic_rm.checkpoint.split_folds import finish_split_folds, held_folds
from elastic_rm.checkpoint.store import CheckpointStore, Refused

TABLES = [
    {"name": "t0", "rows": 3000, "dim": 16},
    {"name": "t1", "rows": 2570, "dim": 16},
    {"name": "t2", "rows": 2000, "dim": 32},  # column-wise
    {"name": "t3", "rows": 40, "dim": 16},  # data-parallel: dense
]
STEPS = [1, 2, 3, 4]
STAGES = ["journal", "hidden", "delta", "applied", "manifest", "deltas", "renamed"]


class Stop(Exception):
    pass


def fold_stopped_at(directory: Path, body: bytes, stage: str) -> None:
    """Run a fold of `directory` and stop it (as a crash would) when it reaches `stage`."""

    def stop(at: str) -> None:
        if at == stage:
            raise Stop(at)

    with pytest.raises(Stop):
        fold_chain(directory, body, on_stage=stop)


def spec(actions: list[dict[str, Any]], shm: Path) -> dict[str, Any]:
    flash = {"memory_root": str(shm), "differential": True, "compact_ratio": 100.0, "keep_memory": 10}
    return {
        "tables": TABLES,
        "optim": "rowwise_adagrad",
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8},
        "phases": [
            {
                "world": 1,
                "nodes": ["n0"],
                "pinned": {"t0": ["rw"], "t1": ["tw"]},
                "flash": flash,
                "actions": actions,
            }
        ],
    }


def manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / MANIFEST).read_bytes())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base and three deltas in n0's memory (no fold: compact_ratio is large), the live state of
    step 4 dumped as "s4"."""
    work = tmp_path_factory.mktemp("chain")
    actions: list[dict[str, Any]] = [{"do": "init"}]
    for step in STEPS:
        actions += [{"do": "train", "seeds": [step]}, {"do": "save", "step": step, "block": True}]
    actions.append({"do": "dump", "name": "s4"})
    results = run_world(1, spec(actions, work / "shm"), work)
    assert [s["kind"] for s in results[0][0]["saves"]] == ["full", "delta", "delta", "delta"]
    return work


def node_copy(saved: Path, to: Path) -> Path:
    shutil.copytree(saved / "shm", to / "shm")
    return to / "shm" / "n0"


def fold_body(node: Path, scratch: Path) -> bytes:
    """The folded base's manifest, as a writer computes it before it touches the base: here from a
    scratch copy folded first (the checkpointer computes it from its snapshot buffers)."""
    shutil.copytree(node, scratch)
    base, top = manifest(scratch / "step-00000001"), manifest(scratch / "step-00000004")
    deltas = [scratch / f"step-{s:08d}" / "__0_delta.erm" for s in STEPS[1:]]
    apply_in_place(scratch / "step-00000001", base["layout"], deltas)
    files = {
        name: {**base["files"][name], **file_entry(scratch / "step-00000001" / name)}
        for name in base["layout"]
    }
    return folded_manifest(base, top, files)


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, bytes]]:
    """The fold's manifest and the node directory after an uninterrupted fold."""
    work = tmp_path_factory.mktemp("reference")
    node = node_copy(saved, work)
    body = fold_body(node, work / "scratch")
    fold_chain(node, body)
    assert sorted(p.name for p in node.iterdir()) == ["step-00000004"]
    return body, tree(node)


@pytest.mark.parametrize("stage", STAGES)
def test_a_fold_stopped_at_each_point_is_finished_to_the_same_bytes(
    saved: Path, reference: tuple[bytes, dict[str, bytes]], tmp_path: Path, stage: str
) -> None:
    body, folded = reference
    node = node_copy(saved, tmp_path)
    fold_stopped_at(node, body, stage)
    assert (node / JOURNAL).is_file()
    links = read_links(node)
    store = CheckpointStore(node)
    if stage == "journal":  # nothing touched yet: the old chain is whole
        assert chain(links, 4) == STEPS
    elif stage != "renamed":  # the base is hidden: no step restores, no reader finds its files
        assert 1 not in links and all(chain(links, s) is None for s in links), links
        assert 1 not in store.listing()["steps"]
        with pytest.raises(Refused):
            store.file_path(1, "__0_0.distcp")
        assert (node / hidden_dirname(1)).is_dir()
    assert recover_fold(node) == 4
    assert tree(node) == folded, stage


def test_a_fold_killed_mid_rewrite_is_finished_at_start_and_restores_bit_for_bit(
    saved: Path, reference: tuple[bytes, dict[str, bytes]], tmp_path: Path
) -> None:
    """SIGKILL after the first delta was written into the base (a half-folded base): the next
    checkpointer's start finishes the fold; the restore takes the folded base, step 4, bit for bit."""
    body, folded = reference
    node = node_copy(saved, tmp_path)
    (tmp_path / "body.json").write_bytes(body)
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from elastic_rm.checkpoint.inplace import fold_chain\n"
        "kill = lambda at: os.kill(os.getpid(), signal.SIGKILL) if at == 'delta' else None\n"
        "fold_chain(Path(sys.argv[1]), Path(sys.argv[2]).read_bytes(), on_stage=kill)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(node), str(tmp_path / "body.json")], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert (node / JOURNAL).is_file() and (node / hidden_dirname(1)).is_dir()
    base_file = node / hidden_dirname(1) / "__0_0.distcp"
    assert base_file.read_bytes() != folded["step-00000004/__0_0.distcp"]  # half folded
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    results = run_world(1, spec(restore, tmp_path / "shm"), tmp_path)
    got = results[0][0]["restores"][0]
    assert got["step"] == 4 and got["skipped"] == [], got
    assert tree(node) == folded
    assert assert_bit_exact(assemble(saved, "s4"), assemble(tmp_path, "restored"), "folded") > 10_000


def test_a_fold_the_directory_cannot_carry_out_touches_nothing(saved: Path, tmp_path: Path) -> None:
    """The peer's server folds a replica only on top of the chain the manifest names: a chain it does
    not hold (already folded, or another checkpoint) is refused (424: the pusher sends the base)."""
    body = fold_body(saved / "shm" / "n0", tmp_path / "scratch")
    store = CheckpointStore(tmp_path / "peer")
    shutil.copytree(saved / "shm" / "n0", tmp_path / "peer" / "replicas" / "n0")
    store.fold("n0", 4, body, keep=1)
    held = tmp_path / "peer" / "replicas" / "n0"
    assert sorted(p.name for p in held.iterdir()) == ["step-00000004"]
    before = tree(held)
    with pytest.raises(Refused) as refused:
        store.fold("n0", 4, body, keep=1)
    assert refused.value.code == 424
    with pytest.raises(FoldRefused):
        fold_chain(held, body)
    assert tree(held) == before
    assert store.listing()["peak_bytes"] > sum(len(b) for b in before.values())


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_delta_refuses_the_fold_naming_it_and_the_chain_stays_restorable(
    saved: Path, tmp_path: Path
) -> None:
    """Every delta is checked against its own manifest before the base is touched: one flipped byte in
    the newest delta refuses the fold with an error naming that file; the directory is as it was
    (no journal, the base where it was), so the chain up to the step before it still restores."""
    node = node_copy(saved, tmp_path)
    body = fold_body(node, tmp_path / "scratch")
    bad = node / "step-00000004" / "__0_delta.erm"
    flip_last_byte(bad)
    before = tree(node)
    with pytest.raises(FoldRefused, match=str(bad)):
        fold_chain(node, body)
    assert tree(node) == before and not (node / JOURNAL).exists()
    assert recover_fold(node) is None and tree(node) == before
    assert chain(read_links(node), 3) == [1, 2, 3]


def test_the_peer_refuses_a_fold_of_a_corrupt_replica_and_touches_nothing(
    saved: Path, tmp_path: Path
) -> None:
    """The same on the peer's side: a replica whose delta does not match its manifest is refused (424:
    the pusher sends a base) with nothing touched, not dropped."""
    body = fold_body(saved / "shm" / "n0", tmp_path / "scratch")
    held = tmp_path / "peer" / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    flip_last_byte(held / "step-00000003" / "__0_delta.erm")
    before = tree(held)
    with pytest.raises(Refused) as refused:
        CheckpointStore(tmp_path / "peer").fold("n0", 4, body, keep=1)
    assert refused.value.code == 424 and "step-00000003/__0_delta.erm" in str(refused.value)
    assert tree(held) == before


def forged(body: bytes, change: Any) -> bytes:
    """`body` with its fields changed by `change` and its self-checksum recomputed (anyone can)."""
    doc = json.loads(body)
    for k in ("v", "format", "manifest_sha256"):
        doc.pop(k)
    change(doc)
    return make_manifest(doc)


def test_a_fold_layout_naming_a_file_outside_the_replica_is_refused(saved: Path, tmp_path: Path) -> None:
    """A fold manifest's layout is checked like its file names: a name that leaves the replica
    directory (or is no file of the manifest) is refused, and the file it names is never opened."""
    body = fold_body(saved / "shm" / "n0", tmp_path / "scratch")
    peer = tmp_path / "a" / "b" / "c" / "peer"
    held = peer / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    victim = tmp_path / "victim.bin"
    shutil.copy(held / "step-00000001" / "__0_0.distcp", victim)
    original = victim.read_bytes()
    before = tree(held)

    def escape(doc: dict[str, Any]) -> None:
        doc["layout"]["../../../../../../../victim.bin"] = doc["layout"].pop("__0_0.distcp")

    with pytest.raises(Refused) as refused:
        CheckpointStore(peer).fold("n0", 4, forged(body, escape), keep=1)
    assert refused.value.code == 424 and "victim.bin" in str(refused.value)
    assert victim.read_bytes() == original and tree(held) == before


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["layout"]["__0_0.distcp"].append(["t", [0]]),  # an item too short
        lambda d: d["layout"]["__0_0.distcp"][0].__setitem__(3, "0"),  # an offset that is no integer
        lambda d: d["layout"].__setitem__("__0_0.distcp", 7),  # a file's items that are no list
        lambda d: d["layout"]["__0_0.distcp"][0].__setitem__(3, 1 << 40),  # past the file's end
        lambda d: d.__setitem__("folded", {"base": [1]}),  # a base that is no step
        lambda d: d.__setitem__("layout", [1, 2]),
        # a block size that is no integer (with no block checksums, the manifest check lets it by)
        lambda d: (
            d["files"]["__0_0.distcp"].update(block="x", blocks=[])
            or d["files"]["__0_0.distcp"].pop("blocks")
        ),
    ],
)
def test_a_malformed_fold_manifest_is_refused_and_leaves_no_journal(
    saved: Path, tmp_path: Path, change: Any
) -> None:
    """A malformed fold body is a clear refusal (424), never a server error that leaves a journal
    behind: the next commit of that source is not blocked by it."""
    body = fold_body(saved / "shm" / "n0", tmp_path / "scratch")
    held = tmp_path / "peer" / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    before = tree(held)
    store = CheckpointStore(tmp_path / "peer")
    with pytest.raises(Refused) as refused:
        store.fold("n0", 4, forged(body, change), keep=1)
    assert refused.value.code == 424, refused.value
    assert tree(held) == before and not (held / JOURNAL).exists()
    store.fold("n0", 4, body, keep=1)  # the good fold goes on
    assert sorted(p.name for p in held.iterdir()) == ["step-00000004"]


def test_a_save_whose_fold_is_refused_is_written_in_full_and_restores(tmp_path: Path) -> None:
    """The checkpointer's side: a delta of the chain corrupted in node memory refuses the fold, and the
    save goes on as a full save (a new base, from the snapshot buffers rolled to this step); the
    newest step restores bit for bit."""
    shm = tmp_path / "shm"
    actions: list[dict[str, Any]] = [{"do": "init"}]
    for step in (1, 2):
        actions += [{"do": "train", "seeds": [step]}, {"do": "save", "step": step, "block": True}]
    actions += [
        {"do": "corrupt", "roots": [str(shm)], "step": 2, "file": "__0_delta.erm", "how": "flip"},
        {"do": "train", "seeds": [3]},
        {"do": "save", "step": 3, "block": True},
        {"do": "dump", "name": "s3"},
        {"do": "restore"},
        {"do": "dump", "name": "restored"},
    ]
    sp = spec(actions, shm)
    sp["phases"][0]["flash"]["compact_ratio"] = 1e-9
    results = run_world(1, sp, tmp_path)
    assert [s["kind"] for s in results[0][0]["saves"]] == ["full", "delta", "fold"]
    step3 = manifest(shm / "n0" / "step-00000003")
    assert step3.get("kind", "full") == "full" and "folded" not in step3 and "layout" in step3
    restored = results[0][0]["restores"][0]
    assert restored["step"] == 3, restored
    assert assert_bit_exact(assemble(tmp_path, "s3"), assemble(tmp_path, "restored"), "full") > 10_000


@pytest.mark.parametrize("stage", ["journal", "hidden", "delta", "manifest", "deltas"])
def test_a_restores_drop_of_newer_steps_drops_a_pending_fold_of_a_newer_step(
    saved: Path, tmp_path: Path, stage: str
) -> None:
    """A fold a crash left pending, whose top (4) is newer than the restored step (1): dropping the
    steps after 1 drops it too, its hidden base and its journal, so that nothing finishes it later into
    a step of the old timeline."""
    node = node_copy(saved, tmp_path)
    body = fold_body(node, tmp_path / "scratch")
    fold_stopped_at(node, body, stage)
    assert (node / JOURNAL).exists()
    drop_newer_than(node, 1)
    assert recover_fold(node) is None
    assert not (node / JOURNAL).exists() and not (node / hidden_dirname(1)).exists()
    assert all(s <= 1 for s in read_links(node)), sorted(read_links(node))
    if stage == "journal":  # its base was not touched yet: it stays
        assert 1 in read_links(node)


def test_a_drop_of_newer_steps_waits_for_a_running_fold_and_then_drops_its_step(
    saved: Path, tmp_path: Path
) -> None:
    """The checkpoint server folds a replica (paused before its rename) while a restore drops the steps
    after 1 there: the drop waits for the fold (the directory's fold lock), then drops the folded step;
    no step of the old timeline comes back."""
    held = tmp_path / "peer" / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    body = fold_body(held, tmp_path / "scratch")
    paused, go = threading.Event(), threading.Event()

    def pause(at: str) -> None:
        if at == "manifest":
            paused.set()
            go.wait(120)

    folding = threading.Thread(target=fold_chain, args=(held, body), kwargs={"on_stage": pause})
    folding.start()
    assert paused.wait(120)
    dropping = threading.Thread(target=drop_newer_than, args=(held, 1))
    dropping.start()
    dropping.join(2)  # bounded: a drop that does not wait for the fold is done by now
    go.set()
    folding.join(120)
    dropping.join(120)
    assert not folding.is_alive() and not dropping.is_alive()
    assert sorted(p.name for p in held.iterdir()) == [], list(held.iterdir())


def test_a_replica_fold_a_server_crash_interrupted_is_finished_when_the_server_starts(
    saved: Path, reference: tuple[bytes, dict[str, bytes]], tmp_path: Path
) -> None:
    """A replica fold stopped mid-rewrite (the server crashed) is finished when the node's checkpoint
    server starts again, before any read: the replica holds the folded base, byte for byte."""
    body, folded = reference
    held = tmp_path / "peer" / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    fold_stopped_at(held, body, "delta")
    assert (held / JOURNAL).exists()
    server = CheckpointServer(tmp_path / "peer").start()
    try:
        assert tree(held) == folded
        assert server.store.listing()["replicas"]["n0"] == [4]
    finally:
        server.stop()


def test_a_fold_stopped_by_a_full_disk_stays_pending_and_is_finished_once_space_returns(
    saved: Path, reference: tuple[bytes, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row written and checked, then the new manifest's write fails (no space left): the fold
    stays pending, its journal and hidden base kept (they are this node's only copy of the chain),
    through further tries while the disk is full; a new fold there is refused meanwhile (it would
    overwrite the journal). Once the write succeeds, the next try finishes it to the same bytes."""
    body, folded = reference
    node = node_copy(saved, tmp_path)
    real_write = inplace.write_file

    def full_disk(path: Path, data: bytes, sync: bool) -> None:
        if path.name == MANIFEST + ".new":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data, sync)

    monkeypatch.setattr(inplace, "write_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        fold_chain(node, body)
    for _ in range(2):
        assert recover_fold(node) is None
        assert (node / JOURNAL).is_file() and (node / hidden_dirname(1)).is_dir()
    with pytest.raises(FoldRefused, match="still pending"):
        fold_chain(node, body)
    assert (node / JOURNAL).is_file() and (node / hidden_dirname(1)).is_dir()
    monkeypatch.setattr(inplace, "write_file", real_write)
    assert recover_fold(node) == 4
    assert tree(node) == folded


def test_a_chain_folded_on_one_copy_only_is_folded_alike_from_the_offered_manifest(
    saved: Path, reference: tuple[bytes, dict[str, bytes]], tmp_path: Path
) -> None:
    """A node folded its memory and its peer's replica of it was left the chain (the node stopped in
    between): the folded manifest the node offers folds the replica to the same bytes. A directory
    whose newest step is not the delta that manifest folded is left as it is."""
    body, folded = reference
    own = node_copy(saved, tmp_path)
    fold_chain(own, body)
    held = tmp_path / "peer" / "replicas" / "n0"
    shutil.copytree(saved / "shm" / "n0", held)
    other = tmp_path / "other" / "n0"
    shutil.copytree(saved / "shm" / "n0", other)
    shutil.rmtree(other / "step-00000004")  # its chain ends at step 3: no offer folds it
    before = tree(other)
    offers, _ = held_folds(memory_dirs(own.parent / "n0"))
    top = read_links(held)[4].sha
    assert offers == {top: body.decode()} and held_folds([held, other, own])[1] == [
        top,
        read_links(other)[3].sha,
    ]
    assert finish_split_folds([held, other, own], offers) == [(held, 4)]
    assert tree(held) == folded
    assert tree(other) == before
    assert finish_split_folds([held], offers) == [] and held_folds([held])[1] == []  # folded: nothing to do


def test_apply_in_place_writes_rows_of_any_width_at_any_offset(tmp_path: Path) -> None:
    """Rows are copied as the widest words their size and both offsets allow: rows of 6, 16, 5 and 8
    bytes, a tensor at an odd offset of the base, a row written by two deltas (the later one wins)."""
    import numpy as np
    import torch

    from elastic_rm.checkpoint.delta_file import DeltaPiece, write_delta

    rng = np.random.default_rng(7)
    tensors = {
        "a": torch.from_numpy(rng.standard_normal((10, 3)).astype(np.float16)),
        "b": torch.from_numpy(rng.standard_normal((12, 4)).astype(np.float32)),
        "c": torch.from_numpy(rng.integers(0, 255, (7, 5), dtype=np.uint8)),
        "d": torch.from_numpy(rng.standard_normal(5)),
    }
    base, items, at = bytearray(b"\x01\x02\x03"), [], 3  # "a" starts at an odd offset
    for name, t in tensors.items():
        raw = t.numpy().tobytes()
        items.append([name, [0] * t.dim(), list(t.shape), at, len(raw)])
        base += raw
        at += len(raw)
        base += bytes(-at % 8 + 3)  # the next tensor at an offset that is not a multiple of 8 either
        at += -at % 8 + 3
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "f").write_bytes(bytes(base))
    want = {n: t.clone() for n, t in tensors.items()}
    deltas = []
    for i, picks in enumerate(
        [{"a": [0, 4, 9], "b": [1, 11], "c": [2, 6], "d": [0, 3]}, {"a": [4], "c": [2]}]
    ):
        pieces = []
        for name, rows in picks.items():
            values = torch.from_numpy(
                rng.integers(0, 255, (len(rows), *tensors[name].shape[1:]), dtype=np.uint8)
            ).to(tensors[name].dtype)
            want[name][rows] = values
            ids = torch.tensor(rows)
            pieces.append(DeltaPiece([name], [0] * values.dim(), values, ids, list(tensors[name].shape)))
        deltas.append(tmp_path / f"d{i}.erm")
        write_delta(deltas[-1], pieces)
    written = apply_in_place(tmp_path / "base", {"f": items}, deltas)
    got = (tmp_path / "base" / "f").read_bytes()
    for name, _, shape, offset, n in items:
        assert got[offset : offset + n] == want[name].numpy().tobytes(), name
        assert len(shape) == want[name].dim()
    assert got[:3] == b"\x01\x02\x03"
    assert written == 3 * 6 + 2 * 16 + 2 * 5 + 2 * 8 + 6 + 5  # every entry of both deltas


def test_a_whole_tensor_and_rows_of_it_in_a_chain_apply_as_in_order(tmp_path: Path) -> None:
    """A delta that holds a tensor whole and another that holds rows of it: the later one's values
    win, whichever it is."""
    import torch

    from elastic_rm.checkpoint.delta_file import DeltaPiece, write_delta

    base = torch.zeros(6, 4)
    items = {"f": [["t", [0, 0], [6, 4], 0, base.numel() * 4]]}
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    rows = torch.full((2, 4), -1.0)
    for name, order in (("rows-last", ["whole", "rows"]), ("whole-last", ["rows", "whole"])):
        d = tmp_path / name
        (d / "base").mkdir(parents=True)
        (d / "base" / "f").write_bytes(base.numpy().tobytes())
        deltas, want = [], base.clone()
        for i, kind in enumerate(order):
            deltas.append(d / f"{i}.erm")
            if kind == "whole":
                write_delta(deltas[-1], [DeltaPiece(["t"], [0, 0], whole)])
                want = whole.clone()
            else:
                write_delta(deltas[-1], [DeltaPiece(["t"], [0, 0], rows, torch.tensor([1, 3]), [6, 4])])
                want[[1, 3]] = rows
        written = apply_in_place(d / "base", items, deltas)
        got = torch.frombuffer(bytearray((d / "base" / "f").read_bytes()), dtype=torch.float32)
        assert torch.equal(got.reshape(6, 4), want), name
        assert written == base.numel() * 4 + rows.numel() * 4, name


def test_a_layout_that_does_not_split_a_tensor_into_whole_rows_is_refused_naming_its_file(
    tmp_path: Path,
) -> None:
    """A base layout whose tensor is not a whole number of rows is refused before any write, naming
    the base's file; a fold that fails while its base is mapped raises its own error (the maps close
    cleanly), so recover_fold can drop a fold that cannot be finished."""
    import numpy as np
    import torch

    from elastic_rm.checkpoint.delta_file import DeltaPiece, write_delta
    from elastic_rm.checkpoint.inplace import checked_plans

    table = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    raw = table.numpy().tobytes()
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "f").write_bytes(raw + bytes(8))
    before = (tmp_path / "base" / "f").read_bytes()
    delta = tmp_path / "d.erm"
    values = torch.full((2, 4), 7.0)
    write_delta(delta, [DeltaPiece(["t"], [0, 0], values, torch.tensor([1, 5]), [12, 4])])
    bad = {"f": [["t", [0, 0], [12, 4], 0, len(raw) + 3]]}
    with pytest.raises(FoldRefused, match=r"base/f: t of 195 bytes is not 12 whole rows"):
        apply_in_place(tmp_path / "base", bad, [delta])
    # the same bad item in a plan given as checked: the write fails on its own error
    good = {"f": [["t", [0, 0], [12, 4], 0, len(raw)]]}
    plans = [
        (d, [(n, at, nbytes + 3, s, e) for n, at, nbytes, s, e in p])
        for d, p in checked_plans(tmp_path / "base", good, [delta])
    ]
    with pytest.raises(ValueError):
        apply_in_place(tmp_path / "base", good, [delta], plans=plans)
    assert (tmp_path / "base" / "f").read_bytes() == before
    assert apply_in_place(tmp_path / "base", good, [delta]) == values.numel() * 4
    want = table.clone()
    want[[1, 5]] = values
    assert (tmp_path / "base" / "f").read_bytes()[: len(raw)] == want.numpy().tobytes()
    assert np.frombuffer((tmp_path / "base" / "f").read_bytes()[len(raw) :], np.uint8).sum() == 0
