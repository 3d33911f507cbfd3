"""Recovery paths of the flash checkpoint: corrupt or partial checkpoints, and a lost node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from erm_harness import assemble, assert_bit_exact, run_world
from test_train_reshard import TABLES, pinned

from elastic_rm.checkpoint.local_servers import node_servers, peer_lists
from elastic_rm.checkpoint.manifest import step_dirname


def phase(world: int, flash: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "world": world,
        "nodes": [f"n{r}" for r in range(world)],
        "pinned": pinned(world),
        "flash": flash,
        "actions": actions,
    }


def spec(phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tables": TABLES,
        "optim": "adagrad",
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8},
        "phases": phases,
    }


def test_corrupt_checkpoints_fall_back_or_fail_clearly(tmp_path: Path) -> None:
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    flash = {"memory_root": str(shm), "durable_dir": str(durable), "keep_memory": 4, "keep_durable": 4}
    roots = [str(shm), str(durable)]
    actions = [
        {"do": "init"},
        {"do": "train", "seeds": [1, 2]},
        {"do": "save", "step": 2},
        {"do": "dump", "name": "s2"},
        {"do": "train", "seeds": [3, 4]},
        {"do": "save", "step": 4},
        # (a) flipped bytes in every copy of a data file: step 4 is skipped, step 2 restored
        {"do": "corrupt", "how": "flip", "step": 4, "file": "__0_0.distcp", "roots": roots},
        {"do": "restore"},
        {"do": "dump", "name": "ra"},
        {"do": "train", "seeds": [5, 6]},
        {"do": "save", "step": 6},
        {"do": "dump", "name": "s6"},
        # (b) truncated memory copy, good durable copy: step 6 restored, that file from durable
        {"do": "corrupt", "how": "truncate", "step": 6, "file": "__1_0.distcp", "roots": [str(shm)]},
        {"do": "restore"},
        {"do": "dump", "name": "rb"},
        {"do": "train", "seeds": [7]},
        {"do": "save", "step": 8},
        # (c) missing manifest everywhere (a partial checkpoint): step 8 skipped, step 6 restored
        {"do": "corrupt", "how": "rm", "step": 8, "file": "manifest.json", "roots": roots},
        {"do": "restore"},
        {"do": "dump", "name": "rc"},
        # (d) nothing good left: a clear error
        {"do": "corrupt", "how": "flip", "step": 6, "file": ".metadata", "roots": roots},
        {"do": "corrupt", "how": "flip", "step": 2, "file": ".metadata", "roots": roots},
        {"do": "restore"},
    ]
    results = run_world(2, spec([phase(2, flash, actions)]), tmp_path)
    r0 = results[0][0]["restores"]
    # (a)
    assert r0[0]["step"] == 2
    assert any("step 4" in s and "checksum mismatch" in s for s in r0[0]["skipped"]), r0[0]["skipped"]
    assert_bit_exact(assemble(tmp_path, "s2"), assemble(tmp_path, "ra"), "fallback to step 2")
    # (b)
    srcs = [res[0]["restores"][1]["file_sources"].get("__1_0.distcp") for res in results]
    assert r0[1]["step"] == 6 and not r0[1]["skipped"]
    assert "durable" in srcs and all(s in (None, "durable") for s in srcs), srcs
    assert_bit_exact(assemble(tmp_path, "s6"), assemble(tmp_path, "rb"), "truncated memory copy")
    # (c)
    assert r0[2]["step"] == 6
    assert any("step 8" in s and "no manifest" in s for s in r0[2]["skipped"]), r0[2]["skipped"]
    assert_bit_exact(assemble(tmp_path, "s6"), assemble(tmp_path, "rc"), "missing manifest")
    # (d)
    err = r0[3].get("error", "")
    assert "no good checkpoint" in err and "step 6" in err and "step 2" in err, r0[3]


# 17 s; CI keeps the replica restore after a SIGKILL (tests/e2e/test_inplace_loss.py) and a restore from the
# durable copy when the memory copy is corrupt (test_corrupt_checkpoints_fall_back_or_fail_clearly, above)
@pytest.mark.slow
def test_node_lost_restores_from_peer_replica_else_durable(tmp_path: Path) -> None:
    """Three simulated nodes, each with its own checkpoint server process serving only its own memory
    directory (as each node's agent does). Replicas are pushed to the ring peer's server over HTTP. Then
    n2 dies: its server is killed and its memory directory deleted. With replication on, world 2
    restores n2's shards from the replica n0 holds (n0 reads it locally, n1 over HTTP), and the durable
    copy is deleted first so it cannot be used; with replication off, n2's files come from durable."""
    m1, d1, m2, d2 = (tmp_path / x for x in ("shm1", "durable1", "shm2", "durable2"))
    rep = {"memory_root": str(m1), "durable_dir": str(d1), "replicate": True}
    norep = {"memory_root": str(m2), "durable_dir": str(d2), "replicate": False}
    nodes3, nodes2 = ["n0", "n1", "n2"], ["n0", "n1"]
    with node_servers(m1, nodes3) as s1, node_servers(m2, nodes3) as s2:
        phases = [
            {
                **phase(
                    3,
                    rep,
                    [
                        {"do": "init"},
                        {"do": "train", "seeds": [1, 2]},
                        {"do": "save", "step": 10},
                        {"do": "dump", "name": "b1"},
                        {"do": "kill", "pid": s1["n2"].proc.pid},
                        {"do": "rm_dir", "path": str(m1 / "n2")},
                        {"do": "rm_dir", "path": str(d1)},
                    ],
                ),
                "peers": peer_lists(s1, nodes3),
            },
            {
                **phase(2, rep, [{"do": "restore"}, {"do": "dump", "name": "r1"}]),
                "peers": peer_lists(s1, nodes2),
            },
            {
                **phase(
                    3,
                    norep,
                    [
                        {"do": "init"},
                        {"do": "train", "seeds": [3, 4]},
                        {"do": "save", "step": 20},
                        {"do": "dump", "name": "b2"},
                        {"do": "kill", "pid": s2["n2"].proc.pid},
                        {"do": "rm_dir", "path": str(m2 / "n2")},
                    ],
                ),
                "peers": peer_lists(s2, nodes3),
            },
            {
                **phase(2, norep, [{"do": "restore"}, {"do": "dump", "name": "r2"}]),
                "peers": peer_lists(s2, nodes2),
            },
        ]
        results = run_world(3, spec(phases), tmp_path, timeout=300)
        assert s1["n2"].proc.wait(timeout=30) != 0 and s2["n2"].proc.wait(timeout=30) != 0  # really killed
    # replicas reached the ring peers only through their servers (n0 -> n1 -> n2 -> n0)
    assert (m1 / "n0" / "replicas" / "n2" / step_dirname(10) / "manifest.json").is_file()
    assert (m1 / "n1" / "replicas" / "n0" / step_dirname(10) / "manifest.json").is_file()
    assert not (m1 / "n2").exists() and not (m2 / "n0" / "replicas").exists()
    r1 = [results[r][1]["restores"][0] for r in range(2)]
    assert all(r["step"] == 10 and r["saved_world"] == 3 for r in r1)
    n2_file = [r["file_sources"].get("__2_0.distcp") for r in r1]
    assert set(n2_file) - {None} <= {"local:n0/replica:n2", "peer:n0"} and "peer:n0" in n2_file, n2_file
    assert all("durable" not in r["sources"] for r in r1)
    assert_bit_exact(assemble(tmp_path, "b1"), assemble(tmp_path, "r1"), "replica restore 3->2")
    r2 = [results[r][3]["restores"][0] for r in range(2)]
    assert all(r["step"] == 20 for r in r2)
    assert "durable" in {r["file_sources"].get("__2_0.distcp") for r in r2}
    assert_bit_exact(assemble(tmp_path, "b2"), assemble(tmp_path, "r2"), "durable restore 3->2")
