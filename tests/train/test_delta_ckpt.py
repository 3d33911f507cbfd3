"""Differential flash checkpoints on real gloo worlds: a delta holds every row that changed since the
previous save (weights and optimizer state), and a chain restores bit for bit at the same world."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from erm_harness import assemble, assert_bit_exact, run_world

from elastic_rm.checkpoint.delta_file import DeltaReader

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


def random_chain(rng: random.Random, first_step: int, saves: int) -> tuple[list[dict[str, Any]], int]:
    """Train a random number of steps (random batches: random touched rows) between saves."""
    actions: list[dict[str, Any]] = []
    step = first_step
    for _ in range(saves):
        n = rng.randint(1, 3)
        actions.append({"do": "train", "seeds": [rng.randrange(1 << 30) for _ in range(n)]})
        step += n
        actions.append({"do": "save", "step": step, "block": True})
    return actions, step


@pytest.mark.parametrize("seed", [7])
def test_property_restored_equals_live_at_worlds_1_2_3(tmp_path: Path, seed: int) -> None:
    """Chains with compactions saved at world 2, then 3, then 1, each restored into the next world
    (2 -> 3 -> 1 -> 2): the restored state equals the saving world's state at its newest save, element
    for element (weights, fused and dense optimizer state)."""
    rng = random.Random(seed)
    worlds = [2, 3, 1, 2]
    phases, step = [], 0
    for k, world in enumerate(worlds):
        actions: list[dict[str, Any]] = (
            [{"do": "init"}]
            if k == 0
            else [
                {"do": "restore"},
                {"do": "dump", "name": f"restored{k}"},
            ]
        )
        if k < len(worlds) - 1:
            chain, step = random_chain(rng, step, rng.randint(6, 9))
            actions += [*chain, {"do": "dump", "name": f"saved{k}"}]
        phases.append(phase(world, tmp_path, actions, compact_ratio=0.4))
    results = run_world(max(worlds), spec(phases), tmp_path, timeout=400)
    kinds = [[s["kind"] for s in results[0][k]["saves"]] for k in range(len(worlds) - 1)]
    flat = [x for ks in kinds for x in ks]
    bases = flat.count("full") + flat.count("fold")
    assert bases >= 4 and flat.count("delta") >= 6, kinds  # chains and compactions
    for k in range(1, len(worlds)):
        restored = results[0][k]["restores"][0]
        last = results[0][k - 1]["saves"][-1]
        assert restored["step"] == last["step"] and restored["skipped"] == [], restored
        n = assert_bit_exact(
            assemble(tmp_path, f"saved{k - 1}"),
            assemble(tmp_path, f"restored{k}"),
            f"world {worlds[k - 1]} -> {worlds[k]} (saves {kinds[k - 1]})",
        )
        assert n > 10_000


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())


def test_refused_chains_fall_back_to_the_newest_complete_one(tmp_path: Path) -> None:
    """A corrupt delta, a missing predecessor and a parent of another run are refused with an error
    naming what is wrong, and the restore takes the newest step whose whole chain is good."""
    roots = [str(tmp_path / "shm"), str(tmp_path / "durable")]
    p0: list[dict[str, Any]] = [{"do": "init"}]
    for step in (1, 2, 3, 4):
        p0 += [
            {"do": "train", "seeds": [10 + step]},
            {"do": "save", "step": step, "block": True},
            {"do": "dump", "name": f"s{step}"},
        ]
    corrupt = {"do": "corrupt", "roots": roots, "step": 4, "file": "__1_delta.erm", "how": "flip"}
    rm_parent = [{"do": "rm_dir", "path": str(tmp_path / d / "step-00000002")} for d in ("shm/n0", "durable")]
    other_run = [
        {"do": "init"},
        {"do": "train", "seeds": [99]},
        {"do": "save", "step": 3, "block": True},
        {"do": "dump", "name": "other3"},
    ]
    # a restore drops the steps newer than the one it restored; step 4 (a delta of the first run's step 3)
    # is kept aside and put back beside the other run's step 3
    step4 = [(tmp_path / d / "step-00000004", tmp_path / "aside" / d) for d in ("shm/n0", "durable")]
    aside = [{"do": "copy_dir", "path": str(src), "to": str(dst)} for src, dst in step4]
    back = [{"do": "copy_dir", "path": str(dst), "to": str(src)} for src, dst in step4]
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    phases = [
        phase(2, tmp_path, [*p0, *aside]),
        phase(2, tmp_path, [corrupt, *restore[:1], {"do": "dump", "name": "r1"}]),
        phase(2, tmp_path, [*rm_parent, *restore[:1], {"do": "dump", "name": "r2"}]),
        phase(2, tmp_path, other_run),
        phase(2, tmp_path, [*back, *restore[:1], {"do": "dump", "name": "r4"}]),
    ]
    results = run_world(2, spec(phases, optim="adagrad"), tmp_path)  # per-element state, taken by rows
    assert [s["kind"] for s in results[0][0]["saves"]] == ["full", "delta", "delta", "delta"]
    assert all(s["tables_full"] == [] for s in results[0][0]["saves"])
    r1 = results[0][1]["restores"][0]
    assert r1["step"] == 3 and "step 4" in r1["skipped"][0] and "__1_delta.erm" in r1["skipped"][0], r1
    assert "checksum mismatch" in r1["skipped"][0]
    assert_bit_exact(assemble(tmp_path, "s3"), assemble(tmp_path, "r1"), "fallback from a corrupt delta")
    r2 = results[0][2]["restores"][0]
    assert r2["step"] == 1, r2
    assert any("step 3 is a delta of step 2, whose manifest.json is missing" in s for s in r2["skipped"]), r2
    assert_bit_exact(assemble(tmp_path, "s1"), assemble(tmp_path, "r2"), "fallback to the older base")
    r4 = results[0][4]["restores"][0]
    assert r4["step"] == 3, r4
    assert "another checkpoint than the one it was built on" in r4["skipped"][0], r4
    assert_bit_exact(assemble(tmp_path, "other3"), assemble(tmp_path, "r4"), "the other run's full step")


def test_compaction_bounds_the_chain_and_prune_keeps_it_whole(tmp_path: Path) -> None:
    """A save whose delta would take the chain past compact_ratio x its base folds the chain before it
    into a new base in place (the base of the step before, its delta on top); node memory keeps
    exactly the newest chain (keep_memory=1), the durable copy every step its persisted steps need.
    A step saved twice, and the first save after a restore, are new bases."""
    actions: list[dict[str, Any]] = [{"do": "init"}]
    for step in range(1, 11):
        actions += [{"do": "train", "seeds": [step]}, {"do": "save", "step": step, "block": True}]
    actions += [{"do": "dump", "name": "s10"}]
    extra = {"compact_ratio": 0.3, "keep_memory": 1, "keep_durable": 1, "persist_every": 3}
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    # elsewhere: a step saved again, and a save after a restore, start a new base
    other = {"memory_root": str(tmp_path / "shm2"), "durable_dir": str(tmp_path / "durable2")}
    again = [{"do": "init"}]
    for step, repeat in ((1, 1), (2, 2), (3, 1), (4, 1)):
        again += [{"do": "train", "seeds": [20 + step]}]
        again += [{"do": "save", "step": step, "block": True}] * repeat
        if step == 2:
            again += [{"do": "restore"}]
    again += [{"do": "dump", "name": "again4"}]
    phases = [
        phase(1, tmp_path, actions, **extra),
        phase(1, tmp_path, again, **other),
        phase(1, tmp_path, [{"do": "restore"}, {"do": "dump", "name": "again_restored"}], **other),
        phase(1, tmp_path, restore, **extra),
    ]
    results = run_world(1, spec(phases), tmp_path)
    assert [s["kind"] for s in results[0][1]["saves"]] == ["full", "delta", "full", "full", "delta"]
    assert results[0][1]["restores"][0]["step"] == 2 and results[0][2]["restores"][0]["step"] == 4
    assert_bit_exact(assemble(tmp_path, "again4"), assemble(tmp_path, "again_restored"), "re-saved")
    saves = results[0][0]["saves"]
    kinds = [s["kind"] for s in saves]
    # a full save is a base; a fold's base is the step before it (its own delta goes on top)
    made = [(s["step"], s["step"] - (s["kind"] == "fold")) for s in saves if s["kind"] in ("full", "fold")]
    assert len(made) >= 3 and "fold" in kinds, kinds
    assert steps_in(tmp_path / "shm" / "n0") == list(range(made[-1][1], 11)), kinds
    persisted = 9  # the third save of every three
    newest_base = max(base for at, base in made if at <= persisted)
    assert steps_in(tmp_path / "durable") == list(range(newest_base, persisted + 1)), kinds
    assert results[0][3]["restores"][0]["step"] == 10
    assert_bit_exact(assemble(tmp_path, "s10"), assemble(tmp_path, "restored"), "after compactions")
