"""A member's loss with rounds in place, end to end: three ermrun nodes train examples/dlrm/train.py
--in-place (TorchRec DLRM, gloo); one is SIGKILLed with its node memory. The survivors' workers hold the
failed collective (``with rnd:``), wait in place, and move into the round of two that the lease expiry
brings: the same processes (the pid in every progress row), restored from the newest committed checkpoint
(the state logged at that step, every value of the model and both optimizers), the lost node's files read
from the replica a survivor holds, each step and sample once after the restore (the ledger's checks). And
the fallbacks (slow): a survivor whose re-entry fails exits, and every survivor restarts with new
processes; a held failure that is no loss is released after the membership grace and restarts as before."""

from __future__ import annotations

import signal
import time

import pytest

from elastic_rm.checkpoint.node_memory import remove_node_memory
from elastic_rm.demo.checks import checks
from tests.e2e.test_closed_loop import (
    cleanup,  # noqa: F401 - a fixture
    current_round,
    events_of,
    make_demo,
    steps_of,
    stop_job,
    wait_for,
)
from tests.e2e.test_inplace_rounds import assert_ledger_ok, in_place_events, pids_of

ARGS = ["--in-place", "--checksum-every", "10"]  # the state digest at every checkpoint step (every 10)


def kill_a_member(demo, endpoint: str) -> tuple[str, list[str], float]:
    """SIGKILL the member that is not the leader's first (any member would do), and remove its node
    memory: a dead machine's memory is gone with it."""
    members = list(current_round(endpoint, demo.run_id).members)
    victim = members[-1]
    node = demo.nodes[victim]
    node.signal(signal.SIGKILL)
    node.killed = t = time.time()
    remove_node_memory(demo.run_id, victim)
    return victim, [m for m in members if m != victim], t


def lose_a_member_of_three(etcd, tmp_path, cleanup, script_args: list[str]):  # noqa: F811
    """Three nodes train 25 steps at world 3, a member is SIGKILLed with its node memory, the survivors
    train 10 steps at world 2 and the job is stopped; every survivor exits 0.
    Returns (demo, victim, survivors, the kill's time)."""
    demo = make_demo(tmp_path, "2:3", script_args=script_args)
    cleanup.append(demo)
    for name in ("node-a", "node-b", "node-c"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 25, 300, "25 steps at world 3")
    victim, survivors, t_kill = kill_a_member(demo, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=2, since=t_kill)) >= 10, 240, "10 steps at world 2")
    stop_job(demo)
    for name in survivors:
        assert demo.nodes[name].proc.returncode == 0
    return demo, victim, survivors, t_kill


def test_survivors_of_a_sigkill_keep_their_processes_and_restore_the_committed_step(etcd, tmp_path, cleanup):  # noqa: F811
    demo, victim, survivors, t_kill = lose_a_member_of_three(etcd, tmp_path, cleanup, ARGS)

    rows = demo.progress()
    # why a survivor restarted instead (a worker that did not hold its failure printed its stacks in its log)
    why = [e.message for e in in_place_events(etcd.endpoint, demo.run_id) if not e.data["in_place"]]
    for name in survivors:  # one process each, before and after the loss
        assert len(pids_of(rows, name)) == 1, f"{name} started new workers: {pids_of(rows, name)}; {why}"
        assert pids_of(rows, name, since=t_kill)
    starts = [r for r in rows if r.get("start") and r["t"] > t_kill]
    assert {r["node"]: r["in_place"] for r in starts} == {n: True for n in survivors}, starts
    # the newest committed checkpoint: a multiple of 10 at most one save behind the last step before the kill
    before = [r["step"] for r in steps_of(rows, world=3) if r["t"] < t_kill]
    last = max(before)
    restored = {r["restored_step"] for r in starts}
    assert len(restored) == 1, starts
    (step,) = restored
    assert step % 10 == 0 and last - 20 < step <= last, (step, last)
    logged = [r for r in rows if r.get("checksum_step") == step and r["world"] == 3 and r["t"] < t_kill]
    assert logged and len({r["checksum"] for r in logged}) == 1, logged
    for r in starts:  # every value of every table and both optimizers, as it was at that step
        assert r["checksum"] == logged[0]["checksum"], (r, logged[0])
    # the lost node's shards: from the replica a survivor holds (its memory, or a survivor's over HTTP)
    lost = [src for r in starts for writer, src in r["restore_files"].values() if writer == victim]
    assert lost, [r["restore_files"] for r in starts]
    allowed = {f"local:{n}" for n in survivors} | {f"peer:{n}" for n in survivors}
    assert {src.split("/")[0] for src in lost} <= allowed, lost  # "/replica:<node>": held there
    after = [r["step"] for r in steps_of(rows, world=2, since=t_kill)]
    assert after[0] == step + 1 and after == list(range(after[0], after[-1] + 1))
    assert_ledger_ok(rows)
    assert all(c["ok"] for c in checks(rows)), [c for c in checks(rows) if not c["ok"]]
    kept = [e for e in in_place_events(etcd.endpoint, demo.run_id) if e.data.get("after_loss")]
    assert {e.node for e in kept} == set(survivors), kept
    assert all(e.data["in_place"] and e.data["world"] == 2 for e in kept), kept
    # each survivor's restore after the loss says its downtime and the steps it trained again
    rounds = {e.data["round"] for e in kept}
    restores = [e for e in events_of(etcd.endpoint, demo.run_id, "restore") if e.data["round"] in rounds]
    assert {e.node for e in restores} == set(survivors), restores
    for e in restores:
        assert e.data["downtime_s"] is not None and e.data["redone_steps"] is not None, e
        assert e.data["redone_steps"] == e.data["last_step_before"] - step, e


@pytest.mark.slow
def test_a_survivor_whose_re_entry_fails_falls_back_to_a_restart(etcd, tmp_path, cleanup):  # noqa: F811
    # global rank 0 of the world of 2 raises right after its new process group is up (in place); its
    # agent sees it exit and restarts; the other survivor's agent sees the newer round and falls back too
    demo = make_demo(tmp_path, "2:3", script_args=[*ARGS, "--raise-in-place-on-rank", "0"])
    cleanup.append(demo)
    for name in ("node-a", "node-b", "node-c"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=3)) >= 15, 300, "15 steps at world 3")
    _victim, survivors, t_kill = kill_a_member(demo, etcd.endpoint)
    wait_for(demo, lambda rows: len(steps_of(rows, world=2, since=t_kill)) >= 10, 300, "10 steps at world 2")
    stop_job(demo)
    for name in survivors:
        assert demo.nodes[name].proc.returncode == 0

    fallbacks = [e for e in in_place_events(etcd.endpoint, demo.run_id) if e.data.get("fallback")]
    assert fallbacks, "the event log must say that the in-place round failed"
    assert any("exited before their first step" in e.data["fallback"] for e in fallbacks), fallbacks
    assert all("falling back to a restart" in e.message for e in fallbacks)
    rows = demo.progress()
    for name in survivors:  # every kept worker was replaced by a new process
        assert len(pids_of(rows, name)) == 2, (name, pids_of(rows, name))
    new = [r for r in rows if r.get("start") and r["t"] > t_kill and not r["in_place"]]
    assert {r["node"] for r in new} == set(survivors), new
    steps = [r["step"] for r in steps_of(rows, world=2, since=new[0]["t"])]
    assert steps[0] == new[0]["restored_step"] + 1 and steps == list(range(steps[0], steps[-1] + 1))
    assert_ledger_ok(rows)


@pytest.mark.slow
def test_a_failure_that_is_no_loss_is_released_and_restarts_as_before(etcd, tmp_path, cleanup):  # noqa: F811
    # rank 1 raises inside the body (no member is lost): both workers hold their failure, no new round
    # comes within the membership grace, the agents tell them to fail; torch's restart follows (new
    # processes, one restart used) and training goes on from the last checkpoint
    demo = make_demo(tmp_path, "2", script_args=[*ARGS, "--raise-at-step", "15"])
    cleanup.append(demo)
    for name in ("node-a", "node-b"):
        demo.start_node(name, etcd.endpoint)
    wait_for(demo, lambda rows: len([r for r in rows if r.get("start")]) >= 4, 300, "the restart")
    wait_for(demo, lambda rows: len(steps_of(rows)) >= 25, 300, "training after the restart")
    stop_job(demo)
    for node in demo.nodes.values():
        assert node.proc.returncode == 0

    failures = [e for e in events_of(etcd.endpoint, demo.run_id, "failure")]
    released = [e for e in failures if "no new round within the membership grace" in e.message]
    assert {e.node for e in released} == {"node-a", "node-b"}, failures
    assert any("--raise-at-step 15" in e.message for e in released), released
    assert all("restart(s) left" in e.message for e in released)
    rows = demo.progress()
    for name in ("node-a", "node-b"):  # the held workers exited; new ones took over
        assert len(pids_of(rows, name)) == 2, (name, pids_of(rows, name))
    assert all(c["ok"] for c in checks(rows)), [c for c in checks(rows) if not c["ok"]]
