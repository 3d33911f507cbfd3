"""Bugs found in `erm launch --slurm`, on the real test cluster."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm_cli import Slurm
from tests.slurm.helpers import actions, launch_events, run_jobs, sleeper_executor, tool_env


def test_a_node_job_whose_sbatch_timed_out_is_followed_not_submitted_again_each_poll(
    slurm, etcd, run_id, tmp_path
):
    """sbatch that Slurm took the job from but that did not answer in time (a busy slurmctld; here a
    wrapper that submits, then hangs past the commands' timeout): the job is in the queue, and erm launch
    does not know its id. It must follow the job once squeue lists it, not submit one more at every poll
    (the queue filled with node jobs of the run that nothing counted, nothing stopped before the end)."""
    real = shutil.which("sbatch", path=slurm.env()["PATH"])
    env = tool_env(tmp_path, "sbatch", f'"{real}" "$@"\nexec sleep 30\n', slurm.env())
    said: list[str] = []
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(
            client,
            slurm,
            run_id,
            tmp_path,
            request=1,
            nodes=1,
            say=said.append,
            slurm=Slurm(env, timeout_s=2),
        )
        try:
            for _ in range(4):  # each tick's sbatch times out after Slurm took its job
                assert executor.tick() is None
                time.sleep(0.3)
            listed = [j for j in run_jobs(slurm, run_id) if j["state"] in ("PENDING", "RUNNING")]
            followed = sorted(executor.nodes)
        finally:
            executor.stop_all("test over")
        assert len(listed) == 1, (listed, said)  # one node wanted: one node job, not one per poll
        assert followed == [listed[0]["id"]], (followed, listed, said)
        assert run_jobs(slurm, run_id) == []  # the stop ended it
        assert actions(launch_events(etcd, run_id), "adopt"), said


@pytest.mark.slow  # 9 s; CI keeps the sbatch-timeout case of this file and the stop tests of tests/slurm
def test_another_users_job_with_a_name_that_is_not_utf8_breaks_neither_the_run_nor_its_stop(
    slurm, etcd, run_id, tmp_path
):
    """squeue --json prints job names and comments as their bytes: one job of anyone on the cluster named
    in Latin-1 (``caf\\xe9``) made every squeue read raise UnicodeDecodeError, which no caller expects
    (only SlurmError): erm launch --slurm ended with a traceback, and its stop, which reads squeue too,
    raised again and left the run's node jobs in the queue."""
    env = slurm.env()
    foreign = subprocess.run(
        [
            b"sbatch",
            b"--parsable",
            b"--job-name=caf\xe9",
            b"--comment=r\xe9sum\xe9",
            b"--output=/dev/null",  # not slurm-<id>.out in the working directory
            b"--wrap=sleep 120",
        ],
        env=env,
        capture_output=True,
        check=True,
    )
    foreign_id = foreign.stdout.strip().decode()
    said: list[str] = []
    try:
        with EtcdClient(etcd.endpoint) as client:
            executor = sleeper_executor(client, slurm, run_id, tmp_path, request=1, nodes=1, say=said.append)
            try:
                assert executor.adopt() == []
                for _ in range(3):
                    assert executor.tick() is None
                    time.sleep(0.3)
                assert len(executor.nodes) == 1, said
            finally:
                left = executor.stop_all("test over")
            assert left == [], said
            ours = Slurm(env).jobs()
            assert [j for j in ours if j.name == f"erm-{run_id}" and not j.ended] == []
    finally:  # the foreign job goes before the next test
        subprocess.run(["scancel", foreign_id], env=env, check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(j.job_id == foreign_id for j in Slurm(env).jobs()):
            time.sleep(0.2)


def test_short_prefixes_of_the_options_erm_launch_sets_are_refused_too():
    """docs/launch.md: --slurm-arg refuses --job-name, --array, --output, --chdir, --wrap... and their short
    forms. sbatch takes any unambiguous prefix (tried on the test cluster: --jo=other named the job other,
    --ar=1-3 made it an array of three, --ch=/tmp moved it); only prefixes of 5 characters or more were
    refused."""

    from launcher.commands.launch_slurm import _sbatch_args

    for arg, option in [
        ("--jo=other", "--job-name"),
        ("--j=other", "--job-name"),
        ("--ar=1-3", "--array"),
        ("--ou=/tmp/x.out", "--output"),
        ("--ch=/tmp", "--chdir"),
        ("--wr=true", "--wrap"),
    ]:
        with pytest.raises(ValueError, match=f"--slurm-arg={arg}: sbatch's {option} cannot be set here"):
            _sbatch_args([arg])
    allowed = [
        "--exclusive",
        "--no-requeue",
        "--nice=5",
        "--ntasks=1",
        "--time=1:00:00",
        "--wait-all-nodes=1",
    ]
    assert _sbatch_args(allowed) == tuple(allowed)


class _BigPartition:
    """Slurm's commands for a partition of 600 nodes (gpu-node-001...), which list no job."""

    NODES = [f"gpu-node-{k:03d}" for k in range(1, 601)]

    def __init__(self):
        self.submitted = 0

    def jobs(self):
        return []

    def submit(self, options, script, test_only=False):
        self.submitted += 1
        return str(100 + self.submitted)

    def node_states(self):
        return {n: "idle" for n in self.NODES}

    def node_partitions(self):
        return {n: frozenset({"debug"}) for n in self.NODES}

    def cancel(self, *job_ids):
        pass

    def cancel_wait_s(self):
        return 1.0


def test_every_node_of_a_large_partition_excluded_is_said_not_a_crash(etcd, run_id, tmp_path):
    """docs/launch.md: no node job is submitted while every node of the run's partitions is excluded, and
    that is said once, naming why each node is out. The event listed every node's name twice (message and
    data): for a partition of 600 nodes (a run that holds them all and wants more, or an --exclude of
    them) past the 16 KiB an event may have, ValueError out of the executor's loop ended erm launch."""
    from dataclasses import replace

    said: list[str] = []
    fake = _BigPartition()
    with EtcdClient(etcd.endpoint) as client:
        executor = sleeper_executor(
            client, None, run_id, tmp_path, request=2, nodes=2, say=said.append, slurm=fake
        )
        executor.options = replace(executor.options, exclude=tuple(fake.NODES))
        assert executor.tick() is None
        assert executor.tick() is None
        executor.nodes.clear()
    why = [m for m in said if "no node of partition(s) debug can take a node job now" in m]
    assert len(why) == 1 and fake.submitted == 0, said
    assert "in --exclude" in why[0] and "gpu-node-001" in why[0], why
    excluded = actions(launch_events(etcd, run_id), "excluded")
    assert len(excluded) == 1 and excluded[0]["excluded_count"] == 600, excluded
