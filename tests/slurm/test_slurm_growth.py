"""Growth past the run's request yields to other jobs on the local Slurm: its node jobs are niced (another
job submitted later starts first), and while another job waits, pending ones are cancelled and no more are
submitted until the queue is empty. The executor runs against the real cluster and etcd; its node jobs'
batch script only sleeps (tests/slurm/helpers.py: sleeper_executor)."""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm_job import GROWTH_MARK, GROWTH_NICE
from elastic_rm.launch.slurm_nodes import STRAGGLER_SPARE
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import DemandRecord, QueueRecord, RoundRecord
from tests.slurm.helpers import (
    actions,
    launch_events,
    sbatch_other,
    sleeper_executor,
    squeue_jobs,
    wait_state,
)

NODES = 6  # tests/slurm/conftest.py's cluster


def _fill_and_grow(client, cluster, executor, run_id: str) -> list[str]:
    """Another user's job holds every node; the leader wants 3 nodes of a run that requests 1: one node
    job at the run's request, two growth node jobs (all pending). Their job ids, request first."""
    wait_state(cluster, sbatch_other(cluster, "blocker", NODES), "RUNNING")
    client.put(Keyspace("/elastic-rm", run_id).demand, DemandRecord(3, "test: grow to 3").to_json())
    assert executor.tick() is None
    ids = sorted(executor.nodes, key=int)
    assert len(ids) == 3 and [executor.nodes[i].growth for i in ids] == [False, True, True]
    jobs = squeue_jobs(cluster)
    assert [jobs[i]["nice"] for i in ids] == [0, GROWTH_NICE, GROWTH_NICE], jobs
    assert [jobs[i]["comment"].endswith(GROWTH_MARK) for i in ids] == [False, True, True], jobs
    return ids


def test_growth_node_jobs_are_niced_so_a_later_job_starts_before_them(slurm, etcd, run_id, tmp_path):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=1)
        request, *growth = _fill_and_grow(client, slurm, executor, run_id)
        later = sbatch_other(slurm, "other-user", NODES - 1)  # submitted after the growth jobs, no tick since
        jobs = squeue_jobs(slurm)
        assert all(jobs[later]["prio"] > jobs[g]["prio"] for g in growth), jobs
        blocker = next(i for i, j in jobs.items() if j["name"] == "blocker")
        slurm.cmd("scancel", blocker)
        wait_state(slurm, later, "RUNNING")
        jobs = squeue_jobs(slurm)
        # the 6 freed nodes: the run's requested node and the later job; the growth jobs wait
        assert jobs[request]["state"] == "RUNNING", jobs
        assert [jobs[g]["state"] for g in growth] == ["PENDING", "PENDING"], jobs


def test_pending_growth_is_cancelled_while_another_job_waits(slurm, etcd, run_id, tmp_path):
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=1)
        request, *growth = _fill_and_grow(client, slurm, executor, run_id)
        # in another partition laid over the same nodes (the test cluster's "other": Nodes=ALL)
        waiting = sbatch_other(slurm, "other-user", 2, partition="other")
        assert executor.tick() is None
        jobs = squeue_jobs(slurm)
        assert request in jobs and not any(jobs.get(g, {}).get("state") == "PENDING" for g in growth), jobs
        queue = QueueRecord.parse("queue", client.get(Keyspace("/elastic-rm", run_id).queue).value)
        assert queue.waiting_nodes == 2
        assert executor.tick() is None and executor.tick() is None
        assert executor.submitted == 3  # held: nothing submitted while the other job waits
        slurm.cmd("scancel", waiting)
        deadline = time.monotonic() + 30
        while waiting in squeue_jobs(slurm):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert executor.tick() is None
        assert executor.submitted == 5  # the queue is empty: growth resumes
        assert sum(n.growth and n.pending for n in executor.nodes.values()) == 2
        executor._events.flush()
    events = launch_events(etcd, run_id)
    stops = actions(events, "stop")
    assert sorted(s["job"] for s in stops) == sorted(growth)
    assert all("yields to them" in s["reason"] for s in stops)
    order = [e.data["action"] for e in events if e.data.get("action") in ("hold", "resume")]
    assert order == ["hold", "resume"]


def test_a_spare_that_replaces_a_straggler_is_no_growth_and_is_submitted_while_others_wait(
    slurm, etcd, run_id, tmp_path
):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=2)
        wait_state(slurm, sbatch_other(slurm, "blocker", NODES), "RUNNING")
        sbatch_other(slurm, "other-user", 2)  # waits
        client.put(
            keys.round, RoundRecord(1, ("b1", "b2"), reason="test", extra={"flagged": ["b2"]}).to_json()
        )
        client.put(keys.demand, DemandRecord(3, STRAGGLER_SPARE).to_json())
        assert executor.tick() is None
        assert executor.others_waiting == 2
        ids = sorted(executor.nodes, key=int)
        assert [executor.nodes[i].growth for i in ids] == [False, False, False]
        assert [squeue_jobs(slurm)[i]["nice"] for i in ids] == [0, 0, 0]
        client.put(keys.demand, DemandRecord(4, "test: grow to 4").to_json())
        assert executor.tick() is None and executor.submitted == 3  # growth past the request: held


def test_growth_inside_a_straggler_demand_is_held_and_no_spare_follows_the_swap(
    slurm, etcd, run_id, tmp_path
):
    """The leader's spare demand may hold growth too (its advice's target): only as many node jobs as the
    round has flagged members are spares; the rest is growth, held while another job waits. Once the round
    swapped the straggler out, a demand that still says "spare" submits no further spare."""
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=2)
        wait_state(slurm, sbatch_other(slurm, "blocker", NODES), "RUNNING")
        sbatch_other(slurm, "other-user", 2)  # waits
        client.put(
            keys.round, RoundRecord(1, ("b1", "b2"), reason="test", extra={"flagged": ["b2"]}).to_json()
        )
        client.put(keys.demand, DemandRecord(4, STRAGGLER_SPARE).to_json())  # 1 spare + 1 held growth
        assert executor.tick() is None
        ids = sorted(executor.nodes, key=int)
        assert executor.submitted == 3 and [executor.nodes[i].growth for i in ids] == [False] * 3
        jobs = squeue_jobs(slurm)
        assert [jobs[i]["nice"] for i in ids] == [0, 0, 0], jobs
        first, straggler, spare = (executor.nodes[i].node_id for i in ids)
        swapped = RoundRecord(
            2, (first, spare), reason="test", extra={"flagged": [], "stragglers": [straggler]}
        )
        client.put(keys.round, swapped.to_json())
        client.put(keys.demand, DemandRecord(3, STRAGGLER_SPARE).to_json())  # the advice kept its reason
        assert executor.tick() is None
        assert executor.submitted == 3  # the straggler's job stopped; a job in its place would be growth
        assert straggler not in {n.node_id for n in executor.nodes.values() if not n.stopping}
        executor._events.flush()
    holds = [e.data for e in launch_events(etcd, run_id) if e.data.get("action") == "hold"]
    assert [h["target_nodes"] for h in holds] == [4], holds
