"""Live parity: the planner reads the same fields from a live job's etcd keys as from the simulator, all
filled (GPU count from the node record, when the round was decided, per-node metrics, the cluster's queue
from the run's ``queue`` key), and a finished run's history record carries the capacity and the model
coefficients that the warm start uses."""

from __future__ import annotations

import json
import time

import numpy as np

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.planner.history import parse_record
from elastic_rm.planner.interface import ClusterSnapshot
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.engine import Simulator
from elastic_rm.planner.sim.tracegen import generate
from elastic_rm.rendezvous.queue_signal import QueueSignal
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import QueueRecord

from .test_planner_in_leader import JOB, RECORD, handlers, join_all


def unfilled(snap: ClusterSnapshot) -> list[str]:
    """The fields the planner reads (docs/planner.md, "What the planner reads") that are empty."""
    out = []
    if snap.current is None or snap.current.decided_at <= 0:
        out.append("current.decided_at")
    if snap.waiting_nodes is None:
        out.append("waiting_nodes")
    for n in snap.nodes:
        m = n.metrics
        checks = {
            "gpu_count": n.gpu_count > 0,
            "cpu_count": n.cpu_count > 0,
            "mem_total_bytes": n.mem_total_bytes > 0,
            "metrics": m is not None,
            "steps": m is not None and m.steps is not None,
            "busy_p50_s": m is not None and m.steps is not None and (m.steps.busy_p50_s or 0) > 0,
            "samples_per_s": m is not None and m.steps is not None and m.steps.samples_per_s > 0,
            "mem_used_bytes": m is not None and m.mem_used_bytes > 0,
        }
        out += [f"{n.node_id}.{k}" for k, ok in checks.items() if not ok]
    for key in ("global_batch", "tables", "dense_params", "request"):
        if not snap.job.get(key):
            out.append(f"job.{key}")
    return out


def sim_snapshot() -> ClusterSnapshot:
    jobs = generate(3, 1, ClusterSpec(machines=8))
    sim = Simulator(jobs, ClusterSpec(machines=8), "ours", 1)
    job = sim.jobs[0]
    job.policy = sim._make_policy()
    assert sim._try_start(job, 600.0)
    sim._policy_tick(job, 600.0)  # the first round
    for t in (660.0, 720.0, 780.0):
        sim._advance(job, t)
    return sim._snapshot(job, 780.0)


def test_live_and_simulated_snapshots_fill_what_the_planner_reads(etcd, tmp_path):
    # a name of its own: the session's etcd is shared, and history under JOB's signature would warm-start
    # test_planner_in_leader's cold-start case
    job = {
        **JOB,
        "name": "ctr-parity",
        "request": {"nodes": 2, "cpu_per_node": 8, "mem_per_node_bytes": 2**33, "gpus_per_node": 2},
    }
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    run_id = f"parity-{time.monotonic_ns()}"
    hs = handlers(etcd, run_id, 2, 2, 2, job_file)
    try:  # the cluster's queue, as an executor that places nodes on a shared pool writes it
        queue = QueueRecord(3, "test: a scheduler with 3 nodes queued", time.time())
        hs[0].services._client.put(Keyspace("/elastic-rm", run_id).queue, queue.to_json())
        for h in hs:  # what the agent's monitor reports on a node with 2 GPUs (none exist here)
            h.services.set_hardware(2, "Test GPU")
        infos = join_all(hs, 2)
        assert {i.world_size for i in infos.values()} == {2}
        record = {**RECORD, "steps": {**RECORD["steps"], "busy_p50_s": 0.008}}
        for h in hs:
            h.services.publish_metrics(json.dumps({**record, "node": h.node_id}).encode())
        leader = next(h._leader for h in hs if h._leader.leading)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and unfilled(live := leader._snapshot()):
            time.sleep(0.1)
        assert unfilled(live) == []
        assert {n.gpu_count for n in live.nodes} == {2}
        assert live.waiting_nodes == 3
        assert live.now - 30 < live.current.decided_at <= live.now  # on the policy's clock
        sim = sim_snapshot()
        assert unfilled(sim) == []
        for snap in (live, sim):  # the planner runs on both
            PlannerPolicy().step(snap, PlannerPolicy().state)

        # the history record: the members' capacity and the leader's latest model coefficients
        keys = Keyspace("/elastic-rm", run_id)
        coef = [1e-5, 0.5, 0.7, 0.002]
        outcome = {"v": 1, "round": infos[0].round if hasattr(infos[0], "round") else 1, "coef": coef}
        with_client = hs[0].services._client
        with_client.put(keys.outcome(99), json.dumps({**outcome, "round": 99}))
        rank0 = next(h for h in hs if h.joined_round.members[0] == h.node_id)
        assert rank0.services.record_history("completed")
        kvs, _ = with_client.get_prefix("/elastic-rm/history/")
        mine = [json.loads(kv.value) for kv in kvs if json.loads(kv.value)["run_id"] == run_id]
        assert len(mine) == 1
        rec = parse_record(mine[0])
        assert rec.capacity == 2.0 and np.allclose(rec.coef, coef)
    finally:
        for h in hs:
            h.release()


def test_the_queue_is_unknown_without_a_record_and_a_malformed_one_tells_nothing(etcd):
    keys = Keyspace("/elastic-rm", f"queue-{time.monotonic_ns()}")
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        assert QueueSignal(client, keys).waiting_nodes() is None  # no executor said: unknown
        client.put(keys.queue, QueueRecord(0, "test").to_json())
        assert QueueSignal(client, keys).waiting_nodes() == 0  # known: nobody waits
        client.put(keys.queue, json.dumps({"v": 1, "waiting_nodes": -2}))
        assert QueueSignal(client, keys).waiting_nodes() is None
        client.put(keys.queue, QueueRecord(5, "test").to_json())
        signal = QueueSignal(client, keys, every_s=3600)
        assert signal.waiting_nodes() == 5
        client.delete(keys.queue)
        assert signal.waiting_nodes() == 5  # read at most every every_s: the leader's pace is not etcd's
