"""When a differential chain (FlashConfig.differential) starts over with a new base, in a world of one.

After close(): ElasticTraining closes its checkpointer when a steps() call ends, and a script may call
steps() again (train, evaluate, train on). close() detached the tracker of touched rows, so every save
after it was silently full. Now the first save after close() is a new base (the rows looked up in
between went unrecorded) and the saves after it are deltas again, which restore the live state.

After a save that raised in its pause: the rows it had taken from the tracker were in no checkpoint, and
the next save was a delta on the old chain without them: its restore silently brought those rows back
to their values of the chain's previous step. Now the next save is a new base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_flash_save_dirs import checkpointer, dmp  # noqa: F401  (a fixture)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from elastic_rm.checkpoint import flash


def train_on(model, ids: list[int]) -> None:
    """One step that looks up `ids` (the fused optimizer updates those rows in the backward)."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f0"], torch.tensor(ids), torch.ones(len(ids), dtype=torch.int32)
    )
    model(kjt).values().sum().backward()


def tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's floating-point state, a sharded table by its local shards."""
    out = []
    for k, v in model.state_dict().items():
        for i, t in enumerate([s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                out.append((f"{k}[{i}]", t))
    return out


def assert_restores_live(ck, model, step: int) -> None:
    """The model zeroed, then restored from the checkpointer's newest step (`step`): the live state again."""
    live = {k: t.clone() for k, t in tensors(model)}
    with torch.no_grad():
        for _, t in tensors(model):
            t.fill_(0.0)
    assert ck.restore().step == step
    for k, t in tensors(model):
        assert torch.equal(t, live[k]), k


def test_differential_saves_go_on_after_close(dmp, tmp_path: Path) -> None:  # noqa: F811
    model = dmp[0]
    ck = checkpointer(dmp, tmp_path / "mem", differential=True, keep_memory=8)
    try:
        kinds = []
        for step, ids in enumerate([[1, 2], [3], [4, 5]], start=1):
            train_on(model, ids)
            kinds.append(ck.save(step, block=True).kind)
        ck.close()  # as ElasticTraining.steps() does when it returns
        train_on(model, [6])  # not recorded: the next save must hold it anyway
        for step, ids in enumerate([[7], [8, 9], [10]], start=4):
            kinds.append(ck.save(step, block=True).kind)
            train_on(model, ids)
        kinds.append(ck.save(7, block=True).kind)
        assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "delta"]
        assert_restores_live(ck, model, 7)
    finally:
        ck.close()


def test_a_save_that_raised_is_followed_by_a_new_base(dmp, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    model = dmp[0]
    ck = checkpointer(dmp, tmp_path / "mem", differential=True, keep_memory=8)
    try:
        train_on(model, [1, 2])
        assert ck.save(1, block=True).kind == "full"
        train_on(model, [3, 4])  # rows 3 and 4 change

        def no_memory(*args, **kwargs):
            raise MemoryError("copying the touched rows")

        monkeypatch.setattr(flash, "take_delta", no_memory)
        with pytest.raises(MemoryError):
            ck.save(2)  # after it took rows 3 and 4 from the tracker
        monkeypatch.undo()
        train_on(model, [5])
        assert ck.save(3, block=True).kind == "full"  # not a delta of row 5 only
        train_on(model, [6])
        assert ck.save(4, block=True).kind == "delta"
        assert_restores_live(ck, model, 4)
    finally:
        ck.close()
