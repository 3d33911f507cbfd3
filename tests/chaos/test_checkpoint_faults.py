"""A process SIGKILLed in the middle of a flash checkpoint save, of its durable persist, and of a restore
into a new world (a reshard): the next world restores one consistent checkpoint, verified bit-exact
against the model as it was at that step, never a mix of two steps.

Real processes (gloo, TorchRec) through tests/train's worker; the fault point is observable because the
faulting rank (tests/chaos/ckpt_fault_worker.py) writes a marker file there and waits; the test then
SIGKILLs it and every other rank by pid, as a node loss takes the whole job down.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from erm_harness import REPO, assemble, assert_bit_exact, run_world  # noqa: E402

from tests.chaos.helpers import record_figures  # noqa: E402

FAULT_WORKER = Path(__file__).with_name("ckpt_fault_worker.py")
TABLES = [
    {"name": "t0", "rows": 64, "dim": 32},
    {"name": "t1", "rows": 61, "dim": 32},
    {"name": "t2", "rows": 48, "dim": 32},
    {"name": "t3", "rows": 40, "dim": 16},
]


def spec(phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tables": TABLES,
        "optim": "adagrad",
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8},
        "phases": phases,
    }


def phase(world: int, flash: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    pinned = {"t0": ["tw"], "t1": ["rw"]} if world % 2 == 0 else {"t0": ["rw"], "t1": ["tw"]}
    return {
        "world": world,
        "nodes": [f"n{r}" for r in range(world)],
        "pinned": pinned,
        "flash": flash,
        "actions": actions,
    }


def run_until_fault(
    nprocs: int,
    spec_: dict[str, Any],
    workdir: Path,
    point: str,
    rank: int,
    step: int,
    durable: Path,
    timeout: float = 300,
) -> dict[str, Any]:
    """Start the ranks with a fault point on `rank`; when it is reached, SIGKILL that rank, then the
    others (each by pid). Returns what happened; fails if the point was never reached."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_ = {**spec_, "workdir": str(workdir)}
    (workdir / "spec.json").write_text(json.dumps(spec_))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "PYTHONHASHSEED": "0",
        "CHAOS_FAULT": point,
        "CHAOS_FAULT_RANK": str(rank),
        "CHAOS_FAULT_STEP": str(step),
        "CHAOS_DIR": str(workdir),
        "CHAOS_DURABLE": str(durable),
    }
    marker = workdir / f"fault-{point}"
    procs, logs = [], []
    try:
        for r in range(nprocs):
            log = open(workdir / f"log-{r}.txt", "w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(FAULT_WORKER), str(workdir / "spec.json"), str(r), str(nprocs)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                )
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not marker.exists():
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        reached = marker.exists()
        t_kill = time.time()
        procs[rank].send_signal(signal.SIGKILL)
        procs[rank].wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the rest of the job goes down with the node (by pid)
                p.wait(30)
        for log in logs:
            log.close()
    if not reached:
        tails = "\n".join((workdir / f"log-{r}.txt").read_text()[-3000:] for r in range(nprocs))
        raise AssertionError(f"fault point {point} on rank {rank} never reached:\n{tails}")
    return {"point": point, "rank": rank, "killed_unix": t_kill}


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def restore_and_dump(world: int, flash: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    results = run_world(
        world,
        spec([phase(world, flash, [{"do": "restore"}, {"do": "dump", "name": "r"}])]),
        workdir,
        timeout=300,
    )
    return [results[r][0]["restores"][0] for r in range(world)]


@pytest.mark.slow
def test_killed_before_publishing_its_memory_copy_restores_the_previous_step_into_a_new_world(tmp_path):
    """Rank 1 dies after writing step 4's files and manifest into step-4.tmp but before the rename that
    publishes them; rank 0 did publish its own copy of step 4 (its manifest names rank 1's files). The
    new world (3 ranks: a reshard) must not load step 4 with a piece missing, nor mix step 4's rank-0 files
    with step 2's rank-1 files: it restores step 2, bit-exact."""
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    flash = {"memory_root": str(shm), "durable_dir": str(durable), "keep_memory": 4}
    actions = [
        {"do": "init"},
        {"do": "train", "seeds": [1, 2]},
        {"do": "save", "step": 2},
        {"do": "dump", "name": "s2"},
        {"do": "train", "seeds": [3, 4]},
        {"do": "dump", "name": "s4"},
        {"do": "save", "step": 4},
    ]
    fault = run_until_fault(
        2, spec([phase(2, flash, actions)]), tmp_path / "w1", "publish_memory", 1, 4, durable
    )
    assert (shm / "n0" / "step-00000004" / "manifest.json").is_file()  # the half-published state
    assert not (shm / "n1" / "step-00000004").exists() and (shm / "n1" / "step-00000004.tmp").is_dir()
    assert not (durable / "step-00000004").exists()
    restores = restore_and_dump(3, flash, tmp_path / "w2")
    assert {r["step"] for r in restores} == {2}, restores
    assert any("step 4" in s for s in restores[0]["skipped"]), restores[0]["skipped"]
    n = assert_bit_exact(assemble(tmp_path / "w1", "s2"), assemble(tmp_path / "w2", "r"), "restored step 2")
    record_figures(
        tmp_path,
        "ckpt_kill_before_memory_publish",
        {**fault, "elements_checked": n, "skipped": restores[0]["skipped"]},
    )


@pytest.mark.slow
def test_killed_mid_durable_persist_with_the_node_lost_restores_the_previous_step(tmp_path):
    """Rank 0 dies halfway through copying a file into the durable step-4.tmp (a torn file); node n1's
    memory is lost with its machine. Step 4's n1 files exist nowhere complete, so the survivor restores
    step 2 (n0's files from memory, n1's from the durable copy), bit-exact; the torn file is never read."""
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    flash = {"memory_root": str(shm), "durable_dir": str(durable), "keep_memory": 4, "keep_durable": 4}
    actions = [
        {"do": "init"},
        {"do": "train", "seeds": [1, 2]},
        {"do": "save", "step": 2},
        {"do": "dump", "name": "s2"},
        {"do": "train", "seeds": [5]},
        {"do": "save", "step": 4},
    ]
    fault = run_until_fault(
        2, spec([phase(2, flash, actions)]), tmp_path / "w1", "persist_copy", 0, 4, durable
    )
    assert (durable / "step-00000004.tmp").is_dir() and not (durable / "step-00000004").exists()
    assert (shm / "n1" / "step-00000004" / "manifest.json").is_file()  # memory commit had finished
    shutil.rmtree(shm / "n1")  # the node is gone with its memory
    restores = restore_and_dump(1, flash, tmp_path / "w2")
    r = restores[0]
    assert r["step"] == 2 and any("step 4" in s for s in r["skipped"]), r
    assert r["file_sources"].get("__1_0.distcp") == "durable", r["file_sources"]
    n = assert_bit_exact(assemble(tmp_path / "w1", "s2"), assemble(tmp_path / "w2", "r"), "restored step 2")
    record_figures(
        tmp_path, "ckpt_kill_mid_durable_persist", {**fault, "elements_checked": n, "skipped": r["skipped"]}
    )


@pytest.mark.slow
def test_killed_mid_restore_into_a_new_world_changes_nothing_and_the_next_restore_is_exact(tmp_path):
    """A world of 3 restoring a checkpoint saved at world 2 (a reshard) loses rank 2 in the middle of the
    load. The checkpoint files are untouched (a restore only reads), and the next world restores it
    bit-exact."""
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    flash = {"memory_root": str(shm), "durable_dir": str(durable)}
    actions = [
        {"do": "init"},
        {"do": "train", "seeds": [1, 2, 3]},
        {"do": "save", "step": 3},
        {"do": "dump", "name": "s3"},
    ]
    run_world(2, spec([phase(2, flash, actions)]), tmp_path / "w1")
    before = {**tree_digest(shm), **{f"durable/{k}": v for k, v in tree_digest(durable).items()}}
    fault = run_until_fault(
        3,
        spec([phase(3, flash, [{"do": "restore"}, {"do": "dump", "name": "x"}])]),
        tmp_path / "w2",
        "restore_load",
        2,
        0,
        durable,
    )
    after = {**tree_digest(shm), **{f"durable/{k}": v for k, v in tree_digest(durable).items()}}
    assert after == before  # the interrupted restore wrote nothing into the checkpoints
    restores = restore_and_dump(3, flash, tmp_path / "w3")
    assert {r["step"] for r in restores} == {3} and not restores[0]["skipped"], restores
    n = assert_bit_exact(
        assemble(tmp_path / "w1", "s3"), assemble(tmp_path / "w3", "r"), "restore after a crash"
    )
    record_figures(tmp_path, "ckpt_kill_mid_restore", {**fault, "elements_checked": n})
