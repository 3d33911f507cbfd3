"""What a restore downloads from peers lies in this node's memory (``fetch/rank<r>/<peer>/``) and is
dropped when the restore ends. A worker killed in the middle of a restore (the agent stops a failed
round's workers) cannot drop it: the next restore on that node must, even when the peer it came from
is gone or the rank that downloaded it is no longer on this node; the copies otherwise hold node memory
(counted in held_bytes) until the job ends. On a real gloo world with TorchRec modules."""

from __future__ import annotations

from pathlib import Path

from erm_harness import run_world

from tests.train.test_delta_fold import phase, spec, trained_saves


def test_a_restore_drops_the_downloads_a_killed_restore_left_on_its_node(tmp_path: Path) -> None:
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    flash = {"differential": True, "memory_root": str(shm), "durable_dir": str(durable)}
    a = phase(2, trained_saves([1, 2]), **flash)
    fetch = shm / "n0" / "fetch"
    step2 = str(shm / "n0" / "step-00000002")
    leftovers = [
        fetch / "rank0" / "n9" / "step-00000002",  # this rank's, from a peer not among today's peers
        fetch / "rank0" / "n9" / "deltas" / "step-00000002",  # a delta thread's fork of it
        fetch / "rank3" / "n1" / "step-00000002",  # a rank of an older, larger world
    ]
    kept = fetch / "script-cache" / "step-00000002"  # a script's own sources' cache: not the restore's
    actions = [{"do": "copy_dir", "path": step2, "to": str(p)} for p in [*leftovers, kept]]
    b = phase(1, [*actions, {"do": "restore"}], **flash)
    results = run_world(2, spec([a, b]), tmp_path)
    assert results[0][1]["restores"][0]["step"] == 2
    left = {str(p.relative_to(fetch).parts[0]) for p in fetch.rglob("*") if p.is_file()}
    assert left == {"script-cache"}, left
