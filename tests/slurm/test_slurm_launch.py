"""`erm launch --slurm` on a real local Slurm (tests/slurm/cluster.py): the run's nodes are Slurm jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm_job import GROWTH_MARK
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from tests.conftest import BIN, REPO
from tests.e2e.helpers import steps_at_world, wait_until
from tests.slurm.helpers import (
    actions,
    agents_pids,
    gone,
    launch,
    launch_events,
    queue_record,
    run_events,
    run_jobs,
    told,
)


# 20 s; CI keeps the run to its end and the Ctrl-C below, and growth and the queue against the real cluster
# (test_slurm_growth.py, test_slurm_queue.py)
@pytest.mark.slow
def test_grows_to_the_wanted_count_reports_the_queue_and_ctrl_c_leaves_nothing(
    etcd, run_id, tmp_path, procs, slurm
):
    p = launch(tmp_path, slurm, etcd, run_id, "2:3")
    procs.append(p)
    in_flight = []

    def three_training():
        in_flight.append(len(run_jobs(slurm, run_id)))
        return sum(steps_at_world(tmp_path, n, 3) > 3 for n in slurm.node_names) == 3

    wait_until(three_training, 120, "3 nodes training", [p])
    events = launch_events(etcd, run_id)
    submits = actions(events, "submit")
    assert len(submits) == 3 and max(in_flight) == 3  # no demand yet: --nnodes MAX, never more
    # the run's request (--nnodes' minimum) was submitted before the executor began, while erm launch
    # loaded ermrun's parser; the growth node job after it, by the executor
    begin = next(e for e in events if e.data.get("action") == "begin")
    first = [e for e in submits if "while erm launch loaded ermrun's parser" in e["reason"]]
    assert len(first) == 2 and all(e["submitted_at"] <= begin.time for e in first), told(events)
    running = {e["host"] for e in actions(events, "running")}
    assert len(running) == 3 and running <= set(slurm.node_names)
    # --nnodes' minimum is the run's request without a job description: the third node is growth
    comments = sorted(j["comment"] for j in run_jobs(slurm, run_id))
    base = f"erm launch run {run_id}"
    assert comments == [base, base, base + GROWTH_MARK], comments

    # other users' jobs that cannot start (each wants every node): their nodes wait, ours do not count;
    # one in the run's partition, one in a partition laid over the same nodes ("other": Nodes=ALL)
    others = [whole_cluster_job(slurm, 60), whole_cluster_job(slurm, 60, "other")]
    waiting = 2 * len(slurm.node_names)
    wait_until(
        lambda: (queue_record(etcd, run_id) or {}).get("waiting_nodes") == waiting,
        30,
        "the other jobs' nodes in the queue key",
        [p],
    )
    status = subprocess.run(
        [os.path.join(BIN, "erm"), "status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = json.loads(status.stdout)
    assert shown["waiting_nodes"] == waiting, status.stderr
    assert shown["queue"]["waiting_nodes"] == waiting and not shown["queue"]["unknown"]
    assert 0 <= shown["queue"]["age_s"] <= shown["queue"]["stale_after_s"]  # the launcher rewrites it
    slurm.cmd("scancel", *others)

    pids = agents_pids(tmp_path, running)
    os.kill(p.pid, signal.SIGINT)  # the launcher alone, as a terminal's Ctrl-C would
    assert p.wait(120) == 130, p.output()[-3000:]
    assert "interrupted: every node job was stopped" in p.output()
    assert run_jobs(slurm, run_id) == []  # nothing of the run left in squeue
    with EtcdClient(etcd.endpoint) as client:
        keys = Keyspace("/elastic-rm", run_id)
        assert client.get_prefix(keys.nodes)[0] == []  # every agent left (revoked its lease)
    wait_until(lambda: all(gone(pid) for pid in pids), 30, "the workers stopped too", [p])


@pytest.mark.slow
def test_a_restarted_launcher_adopts_the_runs_jobs_and_erm_stop_ends_them(
    etcd, run_id, tmp_path, procs, slurm
):
    a = launch(tmp_path, slurm, etcd, run_id, "2")
    procs.append(a)
    wait_until(
        lambda: len([j for j in run_jobs(slurm, run_id) if j["state"] == "RUNNING"]) == 2,
        60,
        "2 node jobs running",
        [a],
    )
    # the node jobs are submitted while erm launch loads ermrun's parser, their "submit" events once it
    # has (with the etcd client): the launcher is killed after it said it started the run
    wait_until(lambda: "node jobs are named" in a.output(), 60, "the first launcher's start", [a])
    before = {j["id"] for j in run_jobs(slurm, run_id)}
    os.kill(a.pid, signal.SIGKILL)  # the launcher dies; its node jobs are Slurm's and keep running
    a.wait(30)
    b = launch(tmp_path, slurm, etcd, run_id, "2", log="launch-b.log")
    procs.append(b)
    wait_until(lambda: "adopted 2 job(s)" in b.output(), 60, "the adoption", [b])
    nodes = [j["node"] for j in run_jobs(slurm, run_id)]
    wait_until(lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in nodes), 120, "2 nodes training", [b])
    assert {j["id"] for j in run_jobs(slurm, run_id)} == before  # no duplicate submitted
    assert len(actions(launch_events(etcd, run_id), "submit")) == 2  # the first launcher's only
    stop = subprocess.run(
        [os.path.join(BIN, "erm"), "stop", run_id, "--endpoint", etcd.endpoint],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert b.wait(120) == 0, b.output()[-3000:]
    wait_until(lambda: run_jobs(slurm, run_id) == [], 30, "no job of the run in squeue", [b])


@pytest.mark.slow
def test_a_node_set_down_is_replaced_on_another_node_and_excluded(etcd, run_id, tmp_path, procs, slurm):
    p = launch(tmp_path, slurm, etcd, run_id, "2", extra=["--blacklist-cooldown", "300"])
    procs.append(p)
    wait_until(
        lambda: len({j["node"] for j in run_jobs(slurm, run_id) if j["state"] == "RUNNING"}) == 2,
        60,
        "2 node jobs running",
        [p],
    )
    first = sorted(j["node"] for j in run_jobs(slurm, run_id))
    wait_until(lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in first), 120, "2 nodes training", [p])
    down, survivor = first
    slurm.cmd("scontrol", "update", f"NodeName={down}", "State=DOWN", "Reason=erm-test")

    def replaced() -> list[str]:
        return [
            j["node"] for j in run_jobs(slurm, run_id) if j["state"] == "RUNNING" and j["node"] != survivor
        ]

    wait_until(lambda: replaced() and replaced()[0] != down, 120, "a replacement node job", [p])
    new = replaced()[0]
    wait_until(
        lambda: steps_at_world(tmp_path, new, 2) > 3 and steps_at_world(tmp_path, survivor, 2) > 6,
        120,
        "the survivor and the replacement training",
        [p],
    )
    events = launch_events(etcd, run_id)
    assert [e["host"] for e in actions(events, "blacklist")] == [down]
    job = next(j["id"] for j in run_jobs(slurm, run_id) if j["node"] == new)
    excluded = next(
        w for w in slurm.cmd("scontrol", "show", "job", job).stdout.split() if w.startswith("ExcNode")
    )
    hosts = slurm.cmd("scontrol", "show", "hostnames", excluded.split("=", 1)[1]).stdout.split()
    assert down in hosts  # the replacement was submitted excluding the DOWN node
    (tmp_path / "stop").write_text("")
    assert p.wait(120) == 0, p.output()[-3000:]


@pytest.mark.slow
def test_the_planners_smaller_demand_gives_the_spare_nodes_back_to_slurm(
    etcd, run_id, tmp_path, procs, slurm
):
    job = json.loads((Path(REPO) / "examples" / "emulated" / "job.json").read_text())
    job["name"] = run_id  # a name of its own: no warm start from another test's run of the same job
    del job["request"]  # no request for the launcher to start from: it asks for MAX until the demand
    job["planner"]["cold_start_nodes"] = 2
    (tmp_path / "job.json").write_text(json.dumps(job))
    emulated = [
        "examples/emulated/train.py",
        "--samples",
        "1000000000",
        "--step-s",
        "0.2",
        "--state",
        str(tmp_path / "state"),
    ]
    p = launch(
        tmp_path, slurm, etcd, run_id, "2:4", extra=["--job", str(tmp_path / "job.json")], script=emulated
    )
    procs.append(p)
    # no demand yet: up to MAX (4); the first round waits for the running ones, the planner's cold start
    # takes 2 (and may keep one as standby), so the node jobs past those end
    wait_until(lambda: actions(launch_events(etcd, run_id), "stopped"), 120, "a node released", [p])
    story = run_events(etcd, run_id)
    events = [e for e in story if e.kind == "launch"]
    before_demand = [e for e in actions(events, "submit") if "no demand from the leader" in e["reason"]]
    assert len(before_demand) == 4, told(story)  # MAX, never more
    demands = [e.data["target_nodes"] for e in story if e.kind == "demand"]
    assert demands[:1] == [2], told(story)  # the cold start's
    # On a loaded machine a node job may join late, after the planner flagged a slow member: the round
    # that swaps them stops the straggler, or a later demand (a spare for it) names another count. Each
    # stop must be one the run's events explain, and the smaller demand must have released a node.
    stops = actions(events, "stop")
    unexplained = [e for e in stops if not stop_explained(e, story)]
    assert not unexplained and any(demand_of(e) is not None for e in stops), told(story)
    released = {e["job"]: e["host"] for e in actions(events, "stopped")}

    def back_to_slurm() -> bool:  # their jobs gone; each node idle, or given to a node job submitted since
        jobs, states = run_jobs(slurm, run_id), slurm.node_states()
        reused = {j["node"] for j in jobs if j["id"] not in released}
        ended = all(j["id"] not in released for j in jobs)
        return ended and all(states[h] == "idle" or h in reused for h in released.values())

    wait_until(back_to_slurm, 30, "released nodes idle", [p])
    kept = {j["id"] for j in run_jobs(slurm, run_id)}
    story = run_events(etcd, run_id)
    submitted = {e["job"] for e in actions([e for e in story if e.kind == "launch"], "submit")}
    assert kept and kept <= submitted and kept.isdisjoint(released), (kept, released, told(story))
    assert_completed(slurm, list(released))  # spares: no failure either
    progress = tmp_path / "state" / "progress.json"
    wait_until(lambda: progress.exists(), 60, "the emulated job's progress", [p])
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(120) == 130, p.output()[-3000:]
    assert run_jobs(slurm, run_id) == []


def test_a_node_job_pending_too_long_is_reported_with_slurms_reason(etcd, run_id, tmp_path, procs, slurm):
    other = whole_cluster_job(slurm, 120)
    wait_until(
        lambda: any(j["id"] == other and j["state"] == "RUNNING" for j in slurm.jobs()), 30, "the blocker"
    )
    p = launch(tmp_path, slurm, etcd, run_id, "1", extra=["--pending-report", "1"])
    procs.append(p)
    wait_until(lambda: actions(launch_events(etcd, run_id), "pending"), 60, "the pending report", [p])
    pending = actions(launch_events(etcd, run_id), "pending")
    assert len(pending) == 1 and pending[0]["reason"] in ("Resources", "Priority"), pending
    assert len(run_jobs(slurm, run_id)) == 1  # one wanted, one in flight: no more submitted while it waits
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(60) == 130, p.output()[-3000:]
    assert run_jobs(slurm, run_id) == []  # the pending node job was cancelled
    slurm.cmd("scancel", other)


def whole_cluster_job(slurm, seconds: int, partition: str | None = None) -> str:
    """Another user's job that wants every node of the cluster (in ``partition``, else the default) and
    sleeps ``seconds`` once it runs; its id."""
    where = ["-p", partition] if partition else []
    argv = [
        "sbatch",
        "--parsable",
        *where,
        "-N",
        str(len(slurm.node_names)),
        "-J",
        "other",
        "-o",
        "/dev/null",
    ]
    return slurm.cmd(*argv, "--wrap", f"sleep {seconds}").stdout.strip()


def demand_of(stop: dict) -> int | None:
    """The demand a stop names ("...; demand N (why)"), or None for a stop of another kind."""
    m = re.search(r"; demand (\d+) \(", stop["reason"])
    return int(m.group(1)) if m else None


def stop_explained(stop: dict, story: list) -> bool:
    """A stop the run's events account for: a demand the leader stated, below the 4 node jobs started
    before it; or a straggler the round replaced, whose host the launcher blacklisted."""
    wanted = demand_of(stop)
    if wanted is not None:
        return wanted < 4 and any(e.kind == "demand" and e.data["target_nodes"] == wanted for e in story)
    m = re.match(r"round (\d+) replaced (\S+) as a straggler", stop["reason"])
    return (
        bool(m)
        and m.group(2) == stop["host"]
        and stop["host"] in {e["host"] for e in actions(story, "blacklist")}
    )


def assert_completed(slurm, job_ids: list[str]) -> None:
    """Slurm recorded these node jobs (ended) COMPLETED with exit code 0 in its job completion log."""
    wait_until(lambda: set(job_ids) <= set(slurm.ended_jobs()), 30, f"jobs {job_ids} in the completion log")
    ended = {j: (slurm.ended_jobs()[j]["JobState"], slurm.ended_jobs()[j]["ExitCode"]) for j in job_ids}
    assert job_ids and all(state == ("COMPLETED", "0:0") for state in ended.values()), ended


@pytest.mark.slow
def test_a_straggler_is_replaced_by_a_new_node_job_and_its_own_ends(etcd, run_id, tmp_path, procs, slurm):
    """One node of the run is slowed (the emulated job spins on it): the leader flags it, asks for a
    spare, swaps it out, and names it in the round's ``stragglers`` field; the launcher submits the new
    node job, then ends the straggler's job and blacklists its host."""
    job = json.loads((Path(REPO) / "examples" / "emulated" / "job.json").read_text())
    job["name"] = run_id
    (tmp_path / "job.json").write_text(json.dumps(job))  # request: 2 nodes
    slow_file, state = tmp_path / "slow", tmp_path / "state"
    emulated = ["examples/emulated/train.py", "--samples", "1000000000", "--step-s", "0.2"]
    emulated += ["--state", str(state), "--slow-file", str(slow_file), "--slow-busy-s", "0.15"]
    extra = ["--job", str(tmp_path / "job.json"), "--blacklist-cooldown", "300"]
    p = launch(tmp_path, slurm, etcd, run_id, "2:3", extra=extra, script=emulated)
    procs.append(p)
    keys = Keyspace("/elastic-rm", run_id)

    def current_round():
        with EtcdClient(etcd.endpoint) as client:
            kv = client.get(keys.round)
        return RoundRecord.parse(keys.round, kv.value) if kv is not None else None

    wait_until(lambda: (state / "progress.json").exists(), 120, "2 nodes training", [p])
    first = current_round()
    assert first is not None and len(first.members) == 2
    assert len(actions(launch_events(etcd, run_id), "submit")) == 2  # the request, not MAX, before a demand
    slow = first.members[1]
    slow_file.write_text(slow)

    def swapped():
        rnd = current_round()
        return rnd is not None and slow in rnd.stragglers and slow not in rnd.members and rnd

    wait_until(swapped, 180, f"a round that replaces {slow} as a straggler", [p])
    rnd = current_round()
    assert len(rnd.members) == 2 and rnd.reason.startswith(f"straggler(s) {slow} replaced by")
    wait_until(
        lambda: slow not in {j["node"] for j in run_jobs(slurm, run_id)}, 60, "the straggler's job ended", [p]
    )
    events = launch_events(etcd, run_id)
    stop = next(e for e in actions(events, "stop") if slow in e["reason"] and "as a straggler" in e["reason"])
    # a member the round dropped, its workers drained and stopped: its job is no failure for Slurm
    assert_completed(slurm, [stop["job"]])
    assert [e["host"] for e in actions(events, "blacklist")] == [slow]
    assert len(actions(events, "submit")) >= 3  # the spare the leader asked for
    done = json.loads((state / "progress.json").read_text())["samples_done"]

    def trained_on() -> bool:
        return json.loads((state / "progress.json").read_text())["samples_done"] > done + 20 * 1024

    wait_until(trained_on, 120, "training goes on without the straggler", [p])
    assert slow not in current_round().members
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(120) == 130, p.output()[-3000:]
    assert run_jobs(slurm, run_id) == []


def test_the_runs_end_cancels_the_node_jobs_that_never_joined(etcd, run_id, tmp_path, procs, slurm):
    blocker = slurm.cmd(
        "sbatch",
        "--parsable",
        "-N",
        str(len(slurm.node_names) - 1),
        "-J",
        "other",
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 300",
    ).stdout.strip()
    wait_until(
        lambda: any(j["id"] == blocker and j["state"] == "RUNNING" for j in slurm.jobs()), 30, "the blocker"
    )
    p = launch(tmp_path, slurm, etcd, run_id, "1:2", steps_max=40)  # no demand: MAX 2, one of them pends
    procs.append(p)
    assert p.wait(180) == 0, p.output()[-3000:]
    stops = actions(launch_events(etcd, run_id), "stop")
    assert len(stops) == 1 and "never joined" in stops[0]["reason"]  # not --exit-grace's "more than 60s"
    assert run_jobs(slurm, run_id) == []
    slurm.cmd("scancel", blocker)
