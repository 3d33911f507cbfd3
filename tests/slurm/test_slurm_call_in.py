"""`erm launch --slurm --call-in` on the local Slurm: a run that started short lends its nodes to a job that
arrives after it and would start on them (elastic_rm.launch.slurm_call_in). The executor runs against the
real cluster and etcd; its node jobs' batch script only sleeps (tests/slurm/helpers.py: sleeper_executor),
and the test writes the round records a leader would."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm_nodes import CALL_IN_HOLD_S
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from tests.conftest import REPO
from tests.e2e.helpers import wait_until
from tests.slurm.helpers import (
    actions,
    launch,
    launch_events,
    sbatch_other,
    sleeper_executor,
    squeue_jobs,
    told,
    wait_state,
)

NODES = 6  # tests/slurm/conftest.py's cluster


def _wait(cluster, executor, what, until) -> None:
    """tick() until ``until()`` holds (bounded)."""
    deadline = time.monotonic() + 30
    while True:
        assert executor.tick() is None
        if until():
            return
        assert time.monotonic() < deadline, f"{what}: {squeue_jobs(cluster)}"
        time.sleep(0.2)


def _deferred(cluster, job_id: str) -> None:
    """Slurm says the job waits for its begin time (at its next scheduling pass: bounded wait)."""
    deadline = time.monotonic() + 30
    while squeue_jobs(cluster)[job_id]["reason"] != "BeginTime":
        assert time.monotonic() < deadline, f"job {job_id} not deferred: {squeue_jobs(cluster)}"
        time.sleep(0.2)


def _short_start(client, cluster, executor, run_id: str) -> tuple[list[str], str]:
    """Another user's job holds 4 of the 6 nodes; the run asks for 3 and starts on the 2 left (round 1
    has them), its third node job pending. Returns the running nodes and the pending job's id."""
    wait_state(cluster, sbatch_other(cluster, "blocker", NODES - 2), "RUNNING")

    def two_running():
        return sum(n.state == "RUNNING" for n in executor.nodes.values()) == 2

    _wait(cluster, executor, "2 of the run's 3 node jobs running", two_running)
    running = sorted(n.node_id for n in executor.nodes.values() if n.state == "RUNNING")
    pending = next(n.job_id for n in executor.nodes.values() if n.pending)
    client.put(Keyspace("/elastic-rm", run_id).round, RoundRecord(1, tuple(running), reason="test").to_json())
    assert executor.tick() is None  # the first round is seen: short of the request of 3
    return running, pending


def test_a_later_job_that_fits_calls_the_short_start_in_and_the_run_asks_again_once_it_runs(
    slurm, etcd, run_id, tmp_path
):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=3, call_in=True)
        running, pending = _short_start(client, slurm, executor, run_id)
        lent = {n.job_id for n in executor.nodes.values() if n.state == "RUNNING"}
        prio = squeue_jobs(slurm)[pending]["prio"]
        later = sbatch_other(slurm, "later", 2)  # pends: no node is idle, the run's pending job is older
        assert executor.tick() is None
        # called in: the running node jobs stop, the pending one waits in its place (same priority)
        assert {n.job_id for n in executor.nodes.values() if n.stopping} == lent
        wait_state(slurm, later, "RUNNING")  # on the lent nodes (no tick meanwhile)
        _deferred(slurm, pending)
        assert squeue_jobs(slurm)[pending]["prio"] == prio
        assert executor.submitted == 3
        mid = sbatch_other(slurm, "mid", 1)  # arrives while the run's node job is deferred
        assert executor.tick() is None  # the caller runs: the run asks Slurm for its nodes again
        assert set(executor.nodes) - {pending} and not lent & set(executor.nodes)
        assert squeue_jobs(slurm)[pending]["reason"] != "BeginTime"
        assert executor.submitted == 5  # the two lent nodes' replacements, behind mid
        slurm.cmd("scancel", later)  # two nodes free: the deferred job kept its place ahead of mid
        wait_state(slurm, pending, "RUNNING")
        wait_state(slurm, mid, "RUNNING")
        jobs = squeue_jobs(slurm)
        assert [
            j["state"] for i, j in jobs.items() if i not in (pending, mid) and j["name"] == f"erm-{run_id}"
        ] == [
            "PENDING",
            "PENDING",
        ], jobs
        slurm.cmd("scancel", mid)
        _wait(
            slurm,
            executor,
            "two of the run's nodes running",
            lambda: sum(n.state == "RUNNING" for n in executor.nodes.values()) == 2,
        )
        # the run is short again and a later job fits on its nodes, but a run is called in once
        again = sbatch_other(slurm, "again", 2)
        for _ in range(3):
            assert executor.tick() is None
        assert squeue_jobs(slurm)[again]["state"] == "PENDING"
        assert not any(n.stopping for n in executor.nodes.values())
        executor._events.flush()
    events = launch_events(etcd, run_id)
    call_in = actions(events, "call_in")
    assert len(call_in) == 1 and call_in[0]["caller"] == later
    assert call_in[0]["lent"] == 2 and call_in[0]["kept"] == 0
    assert call_in[0]["idle"] == 0 and call_in[0]["nodes"] == 2
    stops = actions(events, "stop")
    assert sorted(s["job"] for s in stops) == sorted(lent)
    assert {s["reason"] for s in stops} == {f"called in by {later}"}
    over = [e.message for e in events if e.data.get("action") == "call_in_over"]
    assert len(over) == 1 and f"{later}, which called the run's nodes in, started" in over[0]


def test_a_caller_that_needs_fewer_nodes_than_the_run_holds_takes_only_those(slurm, etcd, run_id, tmp_path):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=4, call_in=True)
        wait_state(slurm, sbatch_other(slurm, "blocker", NODES - 3), "RUNNING")

        def three_running():
            return sum(n.state == "RUNNING" for n in executor.nodes.values()) == 3

        _wait(slurm, executor, "3 of the run's 4 node jobs running", three_running)
        running = sorted(executor.nodes.values(), key=lambda n: n.started_at)
        members = tuple(n.node_id for n in running if n.state == "RUNNING")
        client.put(Keyspace("/elastic-rm", run_id).round, RoundRecord(1, members, reason="test").to_json())
        assert executor.tick() is None
        later = sbatch_other(slurm, "later", 2)  # 0 idle: it needs 2 of the run's 3
        assert executor.tick() is None
        stopping = [n for n in executor.nodes.values() if n.stopping]
        kept = [n for n in executor.nodes.values() if n.state == "RUNNING" and not n.stopping]
        assert len(stopping) == 2 and len(kept) == 1
        assert kept[0].node_id == members[0]  # the newest stop first: the oldest node stays
        wait_state(slurm, later, "RUNNING")
        executor._events.flush()
    (call,) = actions(launch_events(etcd, run_id), "call_in")
    assert call["lent"] == 2 and call["kept"] == 1 and call["caller"] == later


def test_no_call_in_for_a_job_that_does_not_fit_arrived_first_or_without_the_option(
    slurm, etcd, run_id, tmp_path
):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=3, call_in=True)
        _short_start(client, slurm, executor, run_id)
        big = sbatch_other(slurm, "too-big", 3)  # 3 > 0 idle + 2 lent
        for _ in range(3):
            assert executor.tick() is None
        assert not any(n.stopping for n in executor.nodes.values())
        slurm.cmd("scancel", big)
        executor._events.flush()
        assert actions(launch_events(etcd, run_id), "call_in") == []


def test_a_job_that_arrived_after_the_run_and_waited_when_it_started_short_calls_it_in(
    slurm, etcd, run_id, tmp_path
):
    """Static's backfill would have started the later job on the nodes the run started short on: it calls
    them in even though it was already waiting when the run's first round formed."""
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=3, call_in=True)
        wait_state(slurm, sbatch_other(slurm, "blocker", NODES - 2), "RUNNING")
        _wait(
            slurm,
            executor,
            "2 running",
            lambda: sum(n.state == "RUNNING" for n in executor.nodes.values()) == 2,
        )
        waiting = sbatch_other(slurm, "waiting", 2)  # after the run's node jobs, before its first round
        running = sorted(n.node_id for n in executor.nodes.values() if n.state == "RUNNING")
        client.put(
            Keyspace("/elastic-rm", run_id).round, RoundRecord(1, tuple(running), reason="test").to_json()
        )
        assert executor.tick() is None
        assert sum(n.stopping for n in executor.nodes.values()) == 2
        wait_state(slurm, waiting, "RUNNING")
        executor._events.flush()
    assert [c["caller"] for c in actions(launch_events(etcd, run_id), "call_in")] == [waiting]


def test_without_call_in_a_short_start_keeps_its_nodes(slurm, etcd, run_id, tmp_path):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=3)
        _short_start(client, slurm, executor, run_id)
        later = sbatch_other(slurm, "later", 2)
        for _ in range(3):
            assert executor.tick() is None
        assert squeue_jobs(slurm)[later]["state"] == "PENDING"
        assert not any(n.stopping for n in executor.nodes.values())


def test_a_caller_that_still_pends_after_the_bound_gives_the_nodes_back_to_the_run(
    slurm, etcd, run_id, tmp_path
):
    """A job that fits by its node count but cannot start on the lent nodes (here it excludes one of
    them): the run waits for it CALL_IN_HOLD_S (its clock is moved past), then asks for nodes again."""
    moved = [0.0]
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(
            client,
            slurm,
            run_id,
            tmp_path,
            request=3,
            call_in=True,
            clock=lambda: time.monotonic() + moved[0],
        )
        running, deferred = _short_start(client, slurm, executor, run_id)
        stuck = sbatch_other(slurm, "stuck", 2, extra=("-x", running[0]))
        _wait(slurm, executor, "the lent nodes idle", lambda: all(n.pending for n in executor.nodes.values()))
        for _ in range(3):  # the lent nodes are idle and the caller still pends: the run waits
            assert executor.tick() is None
        assert executor.submitted == 3 and squeue_jobs(slurm)[stuck]["state"] == "PENDING"
        _deferred(slurm, deferred)
        moved[0] = CALL_IN_HOLD_S + 1
        assert executor.tick() is None
        assert executor.submitted == 5
        assert squeue_jobs(slurm)[deferred]["reason"] != "BeginTime"
        executor._events.flush()
    over = [e.message for e in launch_events(etcd, run_id) if e.data.get("action") == "call_in_over"]
    assert len(over) == 1 and f"still pends after {CALL_IN_HOLD_S:g}s" in over[0]


# ~60 s: the real erm launch and ermrun over Slurm, the emulated workload keeping its progress in a file
@pytest.mark.slow
def test_a_run_called_in_resumes_from_its_progress_and_finishes(etcd, run_id, tmp_path, procs, slurm):
    """A run of 3 that started on 2 nodes is called in by a later 2-node job: its agents leave without
    closing the run, the later job runs, and the run's new node jobs resume where the old ones stopped."""
    job = json.loads((Path(REPO) / "examples" / "emulated" / "job.json").read_text())
    job["request"] = {"nodes": 3}
    (tmp_path / "job.json").write_text(json.dumps(job))
    state = tmp_path / "state"
    samples = 1024 * 200  # 200 steps of 0.1 s at world 2
    wait_state(slurm, sbatch_other(slurm, "blocker", NODES - 2), "RUNNING")
    script = (
        "examples/emulated/train.py",
        "--samples",
        str(samples),
        "--step-s",
        "0.2",
        "--curve",
        "1:1,8:8",
    )
    extra = ("--call-in", "--job", str(tmp_path / "job.json"))
    p = launch(tmp_path, slurm, etcd, run_id, "1:3", extra=extra, script=(*script, "--state", str(state)))
    procs.append(p)
    progress = state / "progress.json"

    def done() -> int:
        try:
            return json.loads(progress.read_text())["samples_done"]
        except (OSError, ValueError):
            return 0

    wait_until(lambda: done() >= 1024 * 20, 120, "the run training on its 2 nodes", [p])
    later = sbatch_other(slurm, "later", 2)
    wait_until(lambda: squeue_jobs(slurm).get(later, {}).get("state") == "RUNNING", 60, "the later job", [p])
    at_call_in = done()
    assert at_call_in < samples
    slurm.cmd("scancel", later)
    seen = []  # the progress while the run comes back: restarted from zero, it would fall below at_call_in

    def ended() -> bool:
        seen.append(done())
        return p.popen.poll() is not None

    wait_until(ended, 240, "the run to its end", [p])
    assert p.wait(1) == 0, p.output()[-3000:]
    assert min(seen) >= at_call_in and done() >= samples
    events = launch_events(etcd, run_id)
    assert [e["caller"] for e in actions(events, "call_in")] == [later], told(events)
    assert len(actions(events, "call_in_over")) == 1
    # 3 at the start, 2 for the stopped ones once the later job ran (the third waited, deferred)
    assert len(actions(events, "submit")) == 5, told(events)
