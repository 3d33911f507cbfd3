"""Differential flash checkpoints on real gloo worlds: a delta holds every row that changed since the
previous save (weights and optimizer state), and a chain restores bit for bit at the same world."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from erm_harness import assemble, assert_bit_exact, run_world

from elastic_rm.train.delta_file import DeltaReader

TABLES = [
    {"name": "t0", "rows": 300, "dim": 16},
    {"name": "t1", "rows": 257, "dim": 16},  # uneven row-wise split
    {"name": "t2", "rows": 200, "dim": 32},  # column-wise, 4 shards of 8
    {"name": "t3", "rows": 40, "dim": 16},  # data-parallel: dense, copied whole
]


def flash(tmp: Path, **extra: Any) -> dict[str, Any]:
    return {
        "memory_root": str(tmp / "shm"),
        "durable_dir": str(tmp / "durable"),
        "differential": True,
        **extra,
    }


def spec(phases: list[dict[str, Any]], optim: str = "rowwise_adagrad") -> dict[str, Any]:
    return {
        "tables": TABLES,
        "optim": optim,
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8},
        "phases": phases,
    }


def phase(world: int, tmp: Path, actions: list[dict[str, Any]], **flash_extra: Any) -> dict[str, Any]:
    pinned = {"t0": ["tw"], "t1": ["rw"]} if world % 2 == 0 else {"t0": ["rw"], "t1": ["tw"]}
    return {
        "world": world,
        "nodes": [f"n{r}" for r in range(world)],
        "pinned": pinned,
        "flash": flash(tmp, **flash_extra),
        "actions": actions,
    }


def delta_rows(tmp: Path, step: int) -> dict[str, set[int]]:
    """Global dim-0 indices each delta file of `step` holds, per state key (as the dumps name them)."""
    out: dict[str, set[int]] = {}
    dirs = [p for p in (tmp / "shm").glob(f"*/step-{step:08d}")]
    assert dirs, f"no step {step} in node memory"
    manifest = json.loads((dirs[0] / "manifest.json").read_text())
    assert manifest["kind"] == "delta", manifest.get("kind")
    for d in dirs:
        for f in d.glob("*.erm"):
            for p in DeltaReader(f).pieces():
                prefix = {"model": "w", "optim": "o", "dense_optim": "d"}[p.key[0]]
                key = f"{prefix}.{'.'.join(p.key[1:])}"
                if p.rows is not None:
                    rows = set(p.rows.tolist())
                elif p.values.dim() == 0:
                    rows = {0}
                else:
                    rows = {p.offsets[0] + r for r in range(p.values.shape[0])}
                out.setdefault(key, set()).update(rows)
    return out


def changed_rows(a: torch.Tensor, b: torch.Tensor) -> set[int]:
    if a.dim() == 0:
        return {0} if not torch.equal(a, b) else set()
    diff = (a != b).reshape(a.shape[0], -1).any(dim=1)
    return set(torch.nonzero(diff).flatten().tolist())


def test_tracker_misses_nothing_and_chain_restores_bit_exact(tmp_path: Path) -> None:
    """Three saves (a base, two deltas) at world 2: every row whose weight or optimizer state changed
    between two saves is in the delta, fewer rows than the table; a new world 2 restores the chain."""
    saves = [(1, [1, 2]), (2, [3]), (3, [4, 5, 6])]
    actions: list[dict[str, Any]] = [{"do": "init"}]
    for step, seeds in saves:
        actions += [
            {"do": "train", "seeds": seeds},
            {"do": "save", "step": step, "block": True},
            {"do": "dump", "name": f"s{step}"},
        ]
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    results = run_world(2, spec([phase(2, tmp_path, actions), phase(2, tmp_path, restore)]), tmp_path)
    kinds = [s["kind"] for s in results[0][0]["saves"]]
    assert kinds == ["full", "delta", "delta"], kinds
    for s in results[0][0]["saves"][1:]:
        assert 0 < s["rows_touched"] < s["rows_total"] == 300 + 257 + 200, s
        assert s["tables_full"] == []
    for step, _ in saves[1:]:
        before, after = assemble(tmp_path, f"s{step - 1}"), assemble(tmp_path, f"s{step}")
        held = delta_rows(tmp_path, step)
        for key in before:
            changed = changed_rows(before[key], after[key])
            missed = changed - held.get(key, set())
            assert not missed, (
                f"step {step}: {key}: rows {sorted(missed)[:10]} changed but are not in the delta"
            )
        assert any(changed_rows(before[k], after[k]) for k in before if k.startswith("o."))
        untouched = set(range(300)) - held["w.ebc.embedding_bags.t0.weight"]
        assert untouched, "the delta holds every row of t0: nothing to learn from this test"
    restored = results[0][1]["restores"][0]
    assert restored["step"] == 3 and restored["skipped"] == []
    assert assert_bit_exact(assemble(tmp_path, "s3"), assemble(tmp_path, "restored"), "chain 1+2+3") > 10_000
