"""Warm spares end to end: a planned scale-up (2 -> 3 nodes, membership policy) of the example TorchRec
DLRM without ``--in-place``, so that every node starts new workers in the new round. With spares (the
default) each of those workers is a process that was already waiting before the round existed (the staying
nodes' spares warmed while world 2 trained; the joining node's while it waited in the rendezvous), and the
round's outcome is what it is without spares: the restored state equals the drained state (every value of
the model and both optimizers), every step reaches the model once, the sample ledger's checks pass."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.e2e.test_closed_loop import (
    cleanup,  # noqa: F401 - a fixture
    events_of,
    make_demo,
    steps_of,
    stop_job,
    wait_for,
)
from tests.e2e.test_inplace_rounds import assert_ledger_ok, assert_state_carried, pids_of


def waiting_spares(demo, name: str) -> set[int]:
    agent = psutil.Process(demo.nodes[name].proc.pid)
    return {p.pid for p in agent.children(recursive=True) if "spare.py" in " ".join(p.cmdline())}


def world_pids(rows, node: str, world: int) -> set[int]:
    return {r["pid"] for r in rows if r.get("node") == node and "step" in r and r["world"] == world}


@pytest.mark.slow
def test_a_scale_up_starts_every_new_worker_from_a_warm_spare(etcd, tmp_path, cleanup):  # noqa: F811
    demo = make_demo(tmp_path, "2:3")
    cleanup.append(demo)
    for name in ("node-a", "node-b"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=2)) >= 10, 240, "10 steps at world 2")
    before = {
        name: waiting_spares(demo, name) - pids_of(demo.progress(), name) for name in ("node-a", "node-b")
    }
    assert all(len(s) == 1 for s in before.values()), before  # one spare per local rank, waiting
    t_up = time.time()
    demo.start_node("node-c", etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 5, 240, "5 steps at world 3")
    stop_job(demo)
    for node in demo.nodes.values():
        assert node.proc.returncode == 0

    rows = demo.progress()
    for name in ("node-a", "node-b"):  # the world-3 worker is the spare that waited before the round
        assert world_pids(rows, name, 3) == before[name], (name, world_pids(rows, name, 3))
        assert pids_of(rows, name, until=t_up).isdisjoint(before[name])
    used = {e.node: e.data for e in events_of(etcd.endpoint, demo.run_id, "round") if "from_spares" in e.data}
    assert set(pids_of(rows, "node-c")) == set(
        used["node-c"]["from_spares"].values()
    )  # the joining node's too
    starts = [r for r in rows if r.get("start") and r["world"] == 3]
    assert len(starts) == 3 and not any(r["in_place"] for r in starts)
    assert_state_carried(rows, 2, 3)
    assert_ledger_ok(rows)
