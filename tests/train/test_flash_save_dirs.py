"""The directories a flash save writes (a gloo world of one in this process, a one-table TorchRec DMP).

A memory_root or durable_dir the saves cannot write is refused when the checkpointer is made, on every
rank: found by the first save, it failed in the background while the node's other ranks waited at its
barrier for timeout_s. A save that fails while writing (no space left) removes its temporary step
directory from node memory (and a persist, its temporary directory from the durable one): kept until a
later save succeeded, it held the room that save needed. A step number that names no step directory is
refused by save()."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elastic_rm.checkpoint import flash
from elastic_rm.checkpoint.flash import FlashCheckpointer, FlashConfig


@pytest.fixture(scope="module")
def dmp(tmp_path_factory: pytest.TempPathFactory):
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from elastic_rm.train import WorldTopology, plan_sharding

    pg = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        table = EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=20, feature_names=["f0"])
        ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
        sharder = EmbeddingBagCollectionSharder()
        plan = plan_sharding(ebc, WorldTopology.from_env(), sharders=[sharder])
        yield DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan), plan
    finally:
        gc.collect()
        dist.destroy_process_group()


def checkpointer(dmp, memory_root: Path, **kw) -> FlashCheckpointer:
    model, plan = dmp
    cfg = FlashConfig(run_id="dirs", node_id="n0", memory_root=memory_root, peers={}, **kw)
    return FlashCheckpointer(model, plan, None, cfg)


def test_a_memory_root_through_a_file_is_refused_when_made(dmp, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(ValueError, match=r"FlashConfig\.memory_root .*afile is not a directory"):
        checkpointer(dmp, tmp_path / "afile")
    with pytest.raises(ValueError, match=r"FlashConfig\.memory_root .*afile is not a directory"):
        checkpointer(dmp, tmp_path / "afile" / "deeper")
    assert (tmp_path / "afile").read_text() == "not a directory"


def test_a_durable_dir_through_a_file_is_refused_when_made(dmp, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"FlashConfig\.durable_dir .*afile is not a directory"):
        checkpointer(dmp, tmp_path / "mem", durable_dir=tmp_path / "afile" / "ckpt")
    assert not (tmp_path / "mem").exists()  # nothing made


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a directory of mode 0500")
def test_an_unwritable_memory_root_is_refused_when_made(dmp, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(ValueError, match=r"FlashConfig\.memory_root .*ro is not writable"):
            checkpointer(dmp, ro / "mem")
    finally:
        ro.chmod(0o700)


def test_a_save_that_fails_writing_leaves_no_temp_directory(dmp, tmp_path: Path, monkeypatch) -> None:
    ck = checkpointer(dmp, tmp_path / "mem", durable_dir=tmp_path / "durable")
    node = tmp_path / "mem" / "n0"
    try:
        ck.save(1, block=True)
        real = flash.dcp.save

        def no_room(state, storage_writer, process_group):  # part of a shard written, then the disk is full
            (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(flash.dcp, "save", no_room)
        ck.save(2)
        with pytest.raises(RuntimeError, match="No space left on device"):
            ck.wait()
        assert sorted(p.name for p in node.iterdir()) == ["step-00000001"]
        assert ck.wait() == []  # the error was said once
        monkeypatch.setattr(flash.dcp, "save", real)
        ck.save(3, block=True)  # the next save is a full one again, and commits
        assert sorted(p.name for p in node.iterdir()) == ["step-00000001", "step-00000003"]
        assert ck.last_committed == 3 and ck.last_persisted == 3
    finally:
        ck.close()


def test_a_persist_that_fails_writing_leaves_no_temp_directory(dmp, tmp_path: Path, monkeypatch) -> None:
    ck = checkpointer(dmp, tmp_path / "mem", durable_dir=tmp_path / "durable")
    durable = tmp_path / "durable"
    try:
        ck.save(1, block=True)
        real = flash.copy_file

        def no_room(src: Path, dst: Path, sync: bool) -> None:  # part of a file copied, then the disk is full
            dst.write_bytes(src.read_bytes()[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(flash, "copy_file", no_room)
        ck.save(2)
        with pytest.raises(RuntimeError, match="No space left on device"):
            ck.wait()
        assert sorted(p.name for p in durable.iterdir()) == ["step-00000001"]
        monkeypatch.setattr(flash, "copy_file", real)
        ck.save(3, block=True)
        assert sorted(p.name for p in durable.iterdir()) == ["step-00000001", "step-00000003"]
    finally:
        ck.close()


def test_a_step_that_names_no_step_directory_is_refused(dmp, tmp_path: Path) -> None:
    """-1 made a directory "step--0000001" that no listing, restore or prune ever saw (node memory held
    it to the job's end); 2.0 failed the save in the background; True saved step 1."""
    ck = checkpointer(dmp, tmp_path / "mem")
    try:
        for step in (-1, 2.0, True, "3"):
            with pytest.raises(ValueError, match=r"step must be an integer >= 0"):
                ck.save(step)
        assert not (tmp_path / "mem" / "n0").exists() or not list((tmp_path / "mem" / "n0").iterdir())
        ck.save(np.int64(0), block=True)  # numpy's integers are integers
        assert sorted(p.name for p in (tmp_path / "mem" / "n0").iterdir()) == ["step-00000000"]
    finally:
        ck.close()
