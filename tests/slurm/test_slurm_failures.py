"""Node jobs that fail at once, that Slurm suspends, that time out, or that no node can take: what the Slurm
executor does. On the real test cluster where Slurm produces the case in a test's time; a time limit
(a minute at least) and a job caught while COMPLETING (a moment) are squeue records written out, read by
the real executor."""

from __future__ import annotations

import re
import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm_cli import SlurmJob
from elastic_rm.launch.slurm_nodes import START_FAILURES
from elastic_rm.wire.keyspace import Keyspace
from tests.launch.sshd import closed_port
from tests.slurm.conftest import NODES
from tests.slurm.helpers import actions, launch_events, run_jobs, sleeper_executor

POLL_S = 0.3


def _tick_until(executor, done, limit_s: float = 60.0):
    """tick() every POLL_S until done() (or the executor returned an exit status); that status."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        rc = executor.tick()
        if rc is not None or done():
            return rc
        time.sleep(POLL_S)
    raise AssertionError(f"not done within {limit_s:g}s")


def _running(slurm, run_id) -> list[dict]:
    return [j for j in run_jobs(slurm, run_id) if j["state"] == "RUNNING"]


def test_node_jobs_that_fail_at_once_blame_their_hosts_and_the_launcher_gives_up(
    slurm, etcd, run_id, tmp_path
):
    """ermrun cannot start on the nodes (here: the job's python exits 3 at once): each failure names the
    node it ran on, a host that failed twice is blacklisted, and after START_FAILURES such jobs in a row,
    none of which registered, the executor ends the run (exit 1) instead of submitting one a poll."""
    said: list[str] = []
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(
            client, slurm, run_id, tmp_path, request=1, body="exit 3", say=said.append
        )
        rc = _tick_until(executor, lambda: False, limit_s=90)
        executor.stop_all("test over")
    assert rc == 1
    assert executor.submitted == START_FAILURES, "\n".join(said)
    events = launch_events(etcd, run_id)
    failures = actions(events, "failure")
    assert len(failures) == START_FAILURES
    hosts = [re.search(r" on (b\d+) ended FAILED", f["error"]) for f in failures]
    assert all(hosts), failures  # each failure names the node it ran on
    hosts = [h.group(1) for h in hosts]
    for host in {h for h in hosts if hosts.count(h) >= 2}:  # Slurm mostly reuses the first idle node
        assert any(f"host {host} blacklisted" in m for m in said), said
    gave_up = next(m for m in said if "giving up" in m)
    assert f"{START_FAILURES} node jobs in a row ended before their ermrun registered" in gave_up
    assert str(tmp_path / "%j.out") in gave_up  # where the batch script said what failed


def test_a_node_job_slurm_suspends_is_cancelled_and_replaced_on_another_node(slurm, etcd, run_id, tmp_path):
    said: list[str] = []
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, slurm, run_id, tmp_path, request=1, nodes=1, say=said.append)
        _tick_until(executor, lambda: len(_running(slurm, run_id)) == 1)
        first = _running(slurm, run_id)[0]
        slurm.cmd("scontrol", "suspend", first["id"])  # what preemption by suspension does
        _tick_until(
            executor,
            lambda: (
                any(j["id"] != first["id"] for j in _running(slurm, run_id))
                and first["id"] not in {j["id"] for j in run_jobs(slurm, run_id)}
            ),
        )
        replacement = _running(slurm, run_id)[0]
        executor.stop_all("test over")
    assert replacement["node"] != first["node"]  # the suspended job held its node until it ended
    assert slurm.ended_jobs()[first["id"]]["JobState"] == "CANCELLED"
    assert any(f"Slurm job {first['id']}" in m and "Slurm suspended its job" in m for m in said), said
    assert not actions(launch_events(etcd, run_id), "blacklist")  # the scheduler's choice, not the host's


def test_when_no_node_can_take_a_node_job_none_is_submitted_and_the_launcher_says_why(
    slurm, etcd, run_id, tmp_path
):
    """Every node runs one of the run's nodes but one, whose job an admin cancelled (its host is then
    blacklisted): a replacement would be refused by sbatch at every poll, each refusal a FAILED job in
    Slurm's records. None is submitted, and the launcher says once which node is out and why."""
    said: list[str] = []
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(
            client, slurm, run_id, tmp_path, request=NODES, nodes=NODES, say=said.append
        )
        _tick_until(executor, lambda: len(_running(slurm, run_id)) == NODES)
        victim = _running(slurm, run_id)[0]
        slurm.cmd("scancel", victim["id"])
        _tick_until(executor, lambda: any("no node of partition(s) debug" in m for m in said))
        for _ in range(5):
            assert executor.tick() is None
            time.sleep(POLL_S)
        submitted = executor.submitted
        executor.stop_all("test over")
    assert submitted == NODES  # no replacement: every node is out
    ended = [j for j in slurm.ended_jobs().values() if j["Name"] == f"erm-{run_id}"]
    refused = [j for j in ended if j["NodeList"] == "(null)"]  # what a refused sbatch leaves in the records
    assert len(ended) == NODES and refused == [], ended
    why = [m for m in said if "no node of partition(s) debug" in m]
    assert len(why) == 1, said  # said once
    assert f"; {victim['node']}: blacklisted)" in why[0] and ": running a node of this run;" in why[0], why


class _Recorded:
    """Slurm's commands over squeue records the test writes (``listed``), for states the cluster cannot
    produce in a test's time; sbatch takes ids from 100 on."""

    def __init__(self, jobs: list[SlurmJob]):
        self.listed = {j.job_id: j for j in jobs}
        self.next_id = 100
        self.cancelled: list[str] = []

    def jobs(self) -> list[SlurmJob]:
        return list(self.listed.values())

    def submit(self, options: list[str], script: str, test_only: bool = False) -> str:
        job_id, self.next_id = str(self.next_id), self.next_id + 1
        self.listed[job_id] = _job(job_id, "PENDING", "")
        return job_id

    def signal(self, job_id: str, sig: str = "TERM") -> None:
        pass

    def cancel(self, *job_ids: str) -> None:
        self.cancelled += job_ids

    def cancel_wait_s(self) -> float:
        return 12.0

    def node_states(self) -> dict[str, str]:
        return {f"b{k}": "idle" for k in range(1, 5)}

    def node_partitions(self) -> dict[str, frozenset[str]]:
        return {node: frozenset({"debug"}) for node in self.node_states()}


def _job(job_id: str, state: str, nodes: str, run_id: str = "r") -> SlurmJob:
    return SlurmJob(
        job_id, f"erm-{run_id}", f"erm launch run {run_id}", state, nodes, "None", ("debug",), 1, "u", 0
    )


def test_a_time_limit_is_no_host_failure_and_a_registration_clears_the_hosts_count(etcd, run_id, tmp_path):
    """--slurm-arg=--time=...: a node job that reaches it ends TIMEOUT; its host is not to blame, however
    often. A host's failures in a row start over once a node on it registered (the pool is by host, the
    node jobs by id)."""
    slurm = _Recorded([_job("7", "RUNNING", "b1", run_id)])
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, None, run_id, tmp_path, request=1, nodes=1, slurm=slurm)
        assert executor.adopt() == ["7"]
        client.put(keys.node("b1"), "{}")  # its agent registered
        job_id = "7"
        for _ in range(3):  # b1's node job reaches its time limit, three times
            assert executor.tick() is None and executor.nodes[job_id].registered
            slurm.listed[job_id] = _job(job_id, "TIMEOUT", "b1", run_id)
            assert executor.tick() is None  # ended; its replacement submitted
            job_id = str(slurm.next_id - 1)
            slurm.listed[job_id] = _job(job_id, "RUNNING", "b1", run_id)
        assert "b1" not in executor._pool or not executor._pool.blacklisted("b1")
        assert executor._pool.get("b1").failures == 0 if "b1" in executor._pool else True
        # a failure that is the host's counts; a node on that host that registers starts the count over
        assert executor.tick() is None
        slurm.listed[job_id] = _job(job_id, "FAILED", "b1", run_id)
        assert executor.tick() is None
        assert executor._pool.get("b1").failures == 1
        job_id = str(slurm.next_id - 1)
        slurm.listed[job_id] = _job(job_id, "RUNNING", "b1", run_id)
        assert executor.tick() is None
        assert executor.nodes[job_id].registered and executor._pool.get("b1").failures == 0
        events = launch_events(etcd, run_id)
        executor.nodes.clear()
    assert not actions(events, "blacklist")
    assert [f["error"].split(" ended ")[1] for f in actions(events, "failure")] == ["TIMEOUT"] * 3 + [
        "FAILED"
    ]


def test_a_job_found_completing_at_adoption_ends_as_stopped_not_as_a_failure(etcd, run_id, tmp_path):
    """A launcher restarted right after its predecessor's scancel finds the run's jobs COMPLETING: their
    end is that stop, not a lost node (no failure, no blacklist)."""
    slurm = _Recorded([_job("7", "COMPLETING", "b1", run_id)])
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(client, None, run_id, tmp_path, request=1, nodes=1, slurm=slurm)
        assert executor.adopt() == ["7"]
        slurm.listed["7"] = _job("7", "CANCELLED", "b1", run_id)
        assert executor.tick() is None
        events = launch_events(etcd, run_id)
        executor.nodes.clear()
    assert not actions(events, "failure") and not actions(events, "blacklist")
    assert [e["job"] for e in actions(events, "stopped")] == ["7"]


def test_a_node_job_past_its_stop_grace_is_cancelled_while_etcd_is_unreachable(run_id, tmp_path):
    """A node told to stop that does not: its job is cancelled once the stop grace is over, whether or not
    the launcher can read the run from etcd (an etcd outage must not keep a node Slurm would free)."""
    slurm = _Recorded([_job("7", "RUNNING", "b1", run_id)])
    said: list[str] = []
    with EtcdClient(f"127.0.0.1:{closed_port()}", timeout=0.5) as client:
        executor = sleeper_executor(
            client, None, run_id, tmp_path, request=1, nodes=1, slurm=slurm, say=said.append
        )
        assert executor.adopt() == ["7"]
        node = executor.nodes["7"]
        executor._stop(node, "the test gives it back")
        assert executor.tick() is None and slurm.cancelled == []  # within its grace
        node.stop_requested_at -= executor._cfg.stop_grace_s + 1  # its grace is over
        assert executor.tick() is None
        assert slurm.cancelled == ["7"], said
    assert any("cannot read the run from etcd" in s for s in said), said
    assert any("did not stop within" in s for s in said), said
