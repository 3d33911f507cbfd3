"""Differential checkpoints under TorchRec's TrainPipelineSparseDist, which starts the input
distribution of the next batches before the current step trains: a save taken every step holds every
row that changed since the previous one, and the chain restores bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_prefetch_batches import golden_parts, world_of_one  # noqa: F401  (a fixture)
from torch.distributed._shard.sharded_tensor import ShardedTensor

from elastic_rm.checkpoint.chain import take_delta
from elastic_rm.checkpoint.delta_file import DeltaReader
from elastic_rm.checkpoint.snapshot import app_state, local_pieces


def flat_state(elastic) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpointed state, whole (a world of one holds every shard)."""
    out: dict[str, torch.Tensor] = {}

    def walk(value, path: list[str]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, [*path, k])
            return
        (piece,) = local_pieces(value)
        out[json.dumps(path)] = piece[1].detach().clone()

    walk(app_state(elastic.ckpt.dmp, elastic.ckpt.dense_optimizer), [])
    return out


def test_every_step_delta_under_a_read_ahead_pipeline(tmp_path: Path, world_of_one) -> None:  # noqa: F811
    flash = {"differential": True, "compact_ratio": 100.0, "keep_memory": 1}
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    states = {}
    for step in elastic.steps(6):
        if step:
            states[step] = flat_state(elastic)  # the state the save of `step` took
        pipeline.progress(it)
    states[6] = flat_state(elastic)
    mem = tmp_path / "mem" / "n0"
    kinds = {s: json.loads((mem / f"step-{s:08d}" / "manifest.json").read_text())["kind"] for s in states}
    assert kinds == {1: "full", **{s: "delta" for s in range(2, 7)}}, kinds
    untouched_somewhere = False
    for step in range(2, 7):
        held: dict[str, set[int]] = {}
        for p in DeltaReader(mem / f"step-{step:08d}" / "__0_delta.erm").pieces():
            rows = set(p.rows.tolist()) if p.rows is not None else None
            held[json.dumps(p.key)] = rows  # None: the whole tensor
        before, after = states[step - 1], states[step]
        for key in before:
            if torch.equal(before[key], after[key]):
                continue
            assert key in held, f"step {step}: {key} changed and is not in the delta"
            if held[key] is None:
                continue
            a, b = before[key], after[key]
            changed = set(torch.nonzero((a != b).reshape(a.shape[0], -1).any(dim=1)).flatten().tolist())
            assert changed <= held[key], f"step {step}: {key}: rows {sorted(changed - held[key])} missed"
            untouched_somewhere |= len(held[key]) < a.shape[0]
    assert untouched_somewhere, "every delta holds every row: nothing learned"
    del pipeline, it, elastic

    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    assert elastic.restored is not None and elastic.restored.step == 6
    # the restore says where its time went: the chain's delta files (read while the base loaded, and
    # the wait for them after it), its base, the rows applied
    got = elastic.restored
    assert min(got.deltas_s, got.base_s, got.apply_s) > 0
    assert got.deltas_wait_s <= got.deltas_s
    assert got.deltas_wait_s + got.base_s + got.apply_s <= got.load_s
    restored = flat_state(elastic)
    assert sorted(restored) == sorted(states[6])
    for key, value in states[6].items():
        assert torch.equal(restored[key], value), f"{key} differs after restoring the chain"
    del pipeline, it, elastic


def test_steps_newer_than_the_restored_one_go_and_the_new_chain_is_kept(tmp_path: Path, world_of_one) -> None:  # noqa: F811
    # keep_memory=1: were the refused steps 4..6 kept, retention would count old step 6 as the newest
    flash = {"differential": True, "compact_ratio": 100.0, "keep_memory": 1}
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    for _ in elastic.steps(6):
        pipeline.progress(it)
    del pipeline, it, elastic
    mem = tmp_path / "mem" / "n0"
    delta = mem / "step-00000004" / "__0_delta.erm"
    data = bytearray(delta.read_bytes())
    data[-1] ^= 0xFF  # step 4's delta is corrupt: steps 4, 5 and 6 (its chain) are refused
    delta.write_bytes(bytes(data))

    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    assert elastic.restored is not None and elastic.restored.step == 3
    assert sorted(p.name for p in mem.glob("step-*")) == ["step-00000001", "step-00000002", "step-00000003"]
    for _ in elastic.steps(5):  # the new steps 4 and 5
        pipeline.progress(it)
    del pipeline, it, elastic
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    assert elastic.restored is not None and elastic.restored.step == 5
    del pipeline, it, elastic


def test_taking_a_delta_does_not_dispatch_through_sharded_tensor_ops(
    tmp_path: Path,
    world_of_one,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save at every step takes a delta at every step: asking a ShardedTensor its size through the
    tensor API runs its __torch_function__ (argument validation over pytrees), a fixed cost per table
    tensor and save that the metadata answers for nothing."""
    flash = {"differential": True, "compact_ratio": 100.0, "keep_memory": 1}
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=1, flash=flash)
    for _ in elastic.steps(2):
        pipeline.progress(it)
    state = app_state(elastic.ckpt.dmp, elastic.ckpt.dense_optimizer)
    tables = {k: v.metadata().size[0] for k, v in state["model"].items() if isinstance(v, ShardedTensor)}
    assert tables
    touched = {k: torch.tensor([0, n // 2, n - 1]) for k, n in tables.items()}
    calls = []
    real = ShardedTensor.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", str(func)))
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(ShardedTensor, "__torch_function__", classmethod(counting))
    taken = take_delta(state, touched, tables, rank=0)
    monkeypatch.undo()
    assert calls == [], calls
    by_key = {".".join(p.key): p for p in taken.pieces if p.rows is not None}
    for k, n in tables.items():
        assert by_key[f"model.{k}"].rows.tolist() == [0, n // 2, n - 1]
    del pipeline, it, elastic
