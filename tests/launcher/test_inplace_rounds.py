"""Rounds in place end to end: ermrun nodes training examples/dlrm/train.py --in-place (TorchRec DLRM, gloo),
rounds decided by the membership policy. The workers of nodes that stay keep their processes (the pid in
every progress row); the state restored in the new round equals the drained state (the digest of every
value of the model and both optimizers); every step reaches the model once (rank 0's steps are
consecutive, and the sample ledger's checks pass)."""

from __future__ import annotations

import os
import time

import pytest

from launcher.demo import checks
from tests.launcher.test_closed_loop import (
    cleanup,  # noqa: F401 - a fixture
    events_of,
    make_demo,
    steps_of,
    stop_job,
    wait_for,
)


def pids_of(rows, node: str, since: float = 0.0, until: float = float("inf")) -> set[int]:
    return {r["pid"] for r in rows if r.get("node") == node and "step" in r and since <= r["t"] <= until}


def assert_state_carried(rows, world_before: int, world_after: int) -> tuple[int, dict]:
    """The drained state of the old world is the restored state of the new one, and rank 0's steps go
    on from the drained step without a gap or a repeat. Returns (drained step, the new world's start)."""
    drained = [r for r in rows if "drained_step" in r and r["world"] == world_before]
    assert drained, "no drain at the old world"
    step = max(r["drained_step"] for r in drained)
    at_step = [r for r in drained if r["drained_step"] == step]
    assert len({r["checksum"] for r in at_step}) == 1, at_step  # every rank, the same state
    start = next(r for r in rows if r.get("start") and r["world"] == world_after and r["rank"] == 0)
    assert start["restored_step"] == step
    assert start["checksum"] == at_step[0]["checksum"]  # every value of every table and optimizer
    after = [r["step"] for r in steps_of(rows, world=world_after)]
    assert after[0] == step + 1 and after == list(range(after[0], after[-1] + 1))
    before = [r["step"] for r in steps_of(rows, world=world_before)]
    assert before == list(range(before[0], step + 1))  # nothing trained twice: the drain was the last
    return step, start


def assert_ledger_ok(rows) -> None:
    ledger = [c for c in checks(rows) if "ledger" in c["what"]]
    assert ledger and all(c["ok"] for c in ledger), ledger


def in_place_events(endpoint: str, run_id: str) -> list:
    return [e for e in events_of(endpoint, run_id, "round") if "in_place" in e.data]


def test_scale_up_in_place_keeps_the_staying_workers(etcd, tmp_path, cleanup):  # noqa: F811
    demo = make_demo(tmp_path, "2:3", script_args=["--in-place"])
    cleanup.append(demo)
    for name in ("node-a", "node-b"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=2)) >= 15, 240, "15 steps at world 2")
    t_up = time.time()
    demo.start_node("node-c", etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 10, 240, "10 steps at world 3")
    stop_job(demo)
    for node in demo.nodes.values():
        assert node.proc.returncode == 0

    rows = demo.progress()
    for name in ("node-a", "node-b"):
        assert len(pids_of(rows, name)) == 1, f"{name} started new workers: {pids_of(rows, name)}"
    assert pids_of(rows, "node-a", since=t_up) and pids_of(rows, "node-b", since=t_up)
    assert_state_carried(rows, 2, 3)
    starts = [r for r in rows if r.get("start") and r["world"] == 3]
    assert {r["node"]: r["in_place"] for r in starts} == {"node-a": True, "node-b": True, "node-c": False}
    assert_ledger_ok(rows)
    kept = [e for e in in_place_events(etcd.endpoint, demo.run_id) if e.data["in_place"]]
    assert {e.node for e in kept} == {"node-a", "node-b"}, kept
    assert all(e.data["world"] == 3 for e in kept)


def test_a_rank_that_fails_its_in_place_round_falls_back_to_a_restart(etcd, tmp_path, cleanup):  # noqa: F811
    # global rank 1 of the world of 3 is node-b's worker; it raises right after its new process group
    demo = make_demo(tmp_path, "2:3", script_args=["--in-place", "--raise-in-place-on-rank", "1"])
    cleanup.append(demo)
    for name in ("node-a", "node-b"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=2)) >= 15, 240, "15 steps at world 2")
    demo.start_node("node-c", etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 10, 300, "10 steps at world 3")
    stop_job(demo)
    for node in demo.nodes.values():
        assert node.proc.returncode == 0

    fallbacks = [e for e in in_place_events(etcd.endpoint, demo.run_id) if e.data.get("fallback")]
    assert fallbacks, "the event log must say that the in-place round failed"
    assert any(e.node == "node-b" and "exited" in e.data["fallback"] for e in fallbacks), fallbacks
    assert all("falling back to a restart" in e.message for e in fallbacks)
    rows = demo.progress()
    assert len(pids_of(rows, "node-b")) == 2  # the failed worker was replaced by a new process
    start = next(r for r in rows if r.get("start") and r["world"] == 3 and r["rank"] == 0 and not r["in_place"])
    drained = max(r["drained_step"] for r in rows if "drained_step" in r and r["world"] == 2)
    assert start["restored_step"] == drained  # the restart restored the drain's checkpoint
    after = [r["step"] for r in steps_of(rows, world=3, since=start["t"])]
    assert after[0] == drained + 1 and after == list(range(after[0], after[-1] + 1))
    assert_ledger_ok(rows)


def test_scale_down_in_place_the_leaving_ranks_exit_0(etcd, tmp_path, cleanup):  # noqa: F811
    """node-c leaves the world: its agent stops (SIGTERM: it leaves the run); the round of 2 is planned,
    since node-c is alive while the leader decides... so it is drained. The node left out exits its worker 0."""
    demo = make_demo(tmp_path, "2:3", script_args=["--in-place"])
    cleanup.append(demo)
    for name in ("node-a", "node-b", "node-c"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 15, 300, "15 steps at world 3")
    pytest.skip("scale-down driver not written yet")
    os.environ  # placeholder
