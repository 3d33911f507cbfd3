"""Resharding across world sizes through the flash checkpoint: every row of every table and of its
optimizer state bit-exact after the move, and the next step equal to the step the old world takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from erm_harness import assemble, assert_bit_exact, max_diff, run_world

TABLES = [
    {"name": "t0", "rows": 64, "dim": 32},
    {"name": "t1", "rows": 61, "dim": 32},  # uneven row-wise split
    {"name": "t2", "rows": 48, "dim": 32},  # column-wise, 4 shards of 8 at every world size
    {"name": "t3", "rows": 40, "dim": 16},  # data-parallel at every world size
    {"name": "t4", "rows": 57, "dim": 16},  # planner's choice (table- or row-wise)
]


def pinned(world: int) -> dict[str, list[str]]:
    """Force a re-layout at every world-size change: t0/t1 swap table-wise and row-wise."""
    return {"t0": ["tw"], "t1": ["rw"]} if world % 2 == 0 else {"t0": ["rw"], "t1": ["tw"]}


def chain_spec(
    worlds: list[int],
    optim: str,
    tmp: Path,
    tables: list[dict[str, Any]] | None = None,
    column_wise: bool = True,
    pin: Any = pinned,
) -> dict[str, Any]:
    phases = []
    for k, world in enumerate(worlds):
        actions: list[dict[str, Any]] = []
        if k == 0:
            actions += [{"do": "init"}, {"do": "train", "seeds": [1, 2, 3]}]
        else:
            actions += [
                {"do": "restore"},
                {"do": "dump", "name": f"restored{k}"},
                {"do": "train", "seeds": [500 + k]},
                {"do": "dump", "name": f"after{k}"},
                {"do": "train", "seeds": [600 + k, 700 + k]},
            ]
        if k < len(worlds) - 1:
            actions += [
                # non-blocking: the dump and the next training step (gloo collectives on the default
                # group) run while the background save writes the snapshot (collectives on its own group)
                {
                    "do": "save",
                    "step": 10 * (k + 1),
                    "position": {"step": 10 * (k + 1), "phase": k},
                    "block": False,
                },
                {"do": "dump", "name": f"before{k + 1}"},
                {"do": "train", "seeds": [500 + k + 1]},
                {"do": "dump", "name": f"afterref{k + 1}"},
            ]
        phases.append(
            {
                "world": world,
                "nodes": [f"n{r}" for r in range(world)],
                "pinned": pin(world),
                "flash": {
                    "memory_root": str(tmp / "shm"),
                    "durable_dir": str(tmp / "durable"),
                    "replicate": True,
                },
                "actions": actions,
            }
        )
    return {
        "tables": tables or TABLES,
        "optim": optim,
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8} if column_wise else {},
        "phases": phases,
    }


def check_chain(worlds: list[int], optim: str, tmp: Path, **spec: Any) -> list[list[Any]]:
    results = run_world(max(worlds), chain_spec(worlds, optim, tmp, **spec), tmp, timeout=400)
    for k in range(1, len(worlds)):
        assert all(s["bytes"] > 0 for s in results[0][k - 1]["saves"])  # training went on: a snapshot
        restored = results[0][k]["restores"][0]
        assert restored["step"] == 10 * k and restored["saved_world"] == worlds[k - 1]
        assert restored["position"] == {"step": 10 * k, "phase": k - 1}
        n = assert_bit_exact(
            assemble(tmp, f"before{k}"), assemble(tmp, f"restored{k}"), f"{worlds[k - 1]}->{worlds[k]}"
        )
        assert n > 5_000  # weights + optimizer state of all tables
        after, ref = assemble(tmp, f"after{k}"), assemble(tmp, f"afterref{k}")
        assert max_diff(after, assemble(tmp, f"restored{k}")) > 1e-3, "the check step changed nothing"
        assert max_diff(after, ref) < 1e-6, (
            f"{worlds[k - 1]}->{worlds[k]}: next step differs from the old world's"
        )
    return results


# 18 s; CI keeps the 3-2-3 chain below and tests/train/test_delta_ckpt.py's restores at worlds 1, 2, 3
@pytest.mark.slow
def test_reshard_chain_2_3_2_1_2_adagrad(tmp_path: Path) -> None:
    """2->3, 3->2, 2->1 and 1->2 with fused Adagrad in one launch of three processes."""
    check_chain([2, 3, 2, 1, 2], "adagrad", tmp_path)


def test_reshard_with_a_rank_that_holds_no_fused_shard(tmp_path: Path) -> None:
    """Two table-wise tables at world 3 leave rank 2 without fused optimizer state (an empty optim
    dict is a DCP leaf missing from the checkpoint), on the saving side (3->2) and on the loading side
    (2->3)."""
    tables = [t for t in TABLES if t["name"] in ("t0", "t1", "t3")]
    pin = lambda w: {"t0": ["tw"], "t1": ["tw"]} if w == 3 else {"t0": ["rw"], "t1": ["tw"]}  # noqa: E731
    results = check_chain([3, 2, 3], "rowwise_adagrad", tmp_path, tables=tables, column_wise=False, pin=pin)
    for k in (0, 2):  # the world-3 phases
        fused = [results[r][k]["fused_tables"] for r in range(3)]
        assert 0 in fused and max(fused) > 0, f"phase {k}: fused tables per rank {fused}"


@pytest.mark.slow
def test_reshard_chain_2_3_2_1_2_rowwise_adagrad(tmp_path: Path) -> None:
    check_chain([2, 3, 2, 1, 2], "rowwise_adagrad", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adagrad", "rowwise_adagrad"])
def test_reshard_3_to_1(tmp_path: Path, optim: str) -> None:
    check_chain([3, 1], optim, tmp_path)
