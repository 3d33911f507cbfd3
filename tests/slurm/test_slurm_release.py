"""`srun ermrun --slurm-release` in a fixed allocation: a node the run no longer uses goes back to Slurm."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from elastic_rm.launch.slurm_release import should_release
from elastic_rm.wire.records import DemandRecord, RoundRecord
from tests.conftest import REPO
from tests.e2e.helpers import wait_until
from tests.slurm.helpers import CONF


def test_the_spares_beyond_the_demand_release_themselves_the_last_by_name_first():
    rnd = RoundRecord(round=1, members=("b1", "b2"), standby=("b3",), sealed=True)
    registered = {"b1", "b2", "b3", "b4", "b5"}
    want = DemandRecord(target_nodes=4)
    assert [n for n in sorted(registered) if should_release(n, want, rnd, registered)] == ["b5"]
    three = DemandRecord(target_nodes=3)
    assert [n for n in sorted(registered) if should_release(n, three, rnd, registered)] == ["b4", "b5"]
    assert not any(should_release(n, DemandRecord(target_nodes=5), rnd, registered) for n in registered)
    unsealed = RoundRecord(round=1, members=("b1", "b2"), sealed=False)
    assert not any(should_release(n, want, unsealed, registered) for n in registered)
    assert not any(should_release(n, None, rnd, registered) for n in registered)
    assert [n for n in sorted(registered) if should_release(n, want, rnd, registered, stays={"b5"})] == ["b4"]


@pytest.mark.slow
def test_a_spare_node_of_the_allocation_is_given_back_and_training_goes_on(etcd, run_id, tmp_path, slurm):
    job = json.loads((Path(REPO) / "examples" / "emulated" / "job.json").read_text())
    job["name"] = run_id
    # one node requested of the allocation's 3, none kept as standby, none lent past the request: two
    # spares from the start, whichever registered first, and at least one is not the batch script's node
    # (which stays); the planner does not scale up to use them
    job["request"]["nodes"] = 1
    job["planner"].update(standby_max=0, lent_node_gain=1.0)
    (tmp_path / "job.json").write_text(json.dumps(job))
    state = tmp_path / "state"
    script = (
        "#!/bin/sh\n"
        f"srun --kill-on-bad-exit=0 {sys.executable} -m launcher.ermrun --slurm-release --nnodes 1:3 "
        f"--nproc-per-node 1 --rdzv-endpoint {etcd.endpoint} --rdzv-id {run_id} --rdzv-conf {CONF} "
        f"--job {tmp_path / 'job.json'} --monitor-interval 0.1 examples/emulated/train.py "
        f"--samples 1000000000 --step-s 0.2 --state {state}\n"
    )
    (tmp_path / "job.sh").write_text(script)
    # the job's TMPDIR is the test's: Slurm may end a given-back node's task before it removes its scratch
    (tmp_path / "tmp").mkdir()
    r = slurm.cmd(
        "sbatch",
        "--parsable",
        "-N",
        "3",
        "-J",
        "fixed",
        f"--chdir={REPO}",
        f"--export=ALL,TMPDIR={tmp_path / 'tmp'}",
        f"--output={tmp_path / 'job.out'}",
        str(tmp_path / "job.sh"),
    )
    job_id = r.stdout.strip()

    def nodes() -> list[str]:
        listed = [j["node"] for j in slurm.jobs() if j["id"] == job_id]
        return slurm.cmd("scontrol", "show", "hostnames", listed[0]).stdout.split() if listed else []

    wait_until(lambda: len(nodes()) == 3, 60, "the allocation of 3 nodes")
    first = nodes()
    log = tmp_path / "job.out"
    try:
        wait_until(lambda: len(nodes()) == 2, 180, f"the allocation shrunk to 2 nodes\n{_tail(log)}")
        released = sorted(set(first) - set(nodes()))
        assert len(released) == 1 and released[0] != first[0]  # never the batch script's node
        wait_until(lambda: slurm.node_states()[released[0]] == "idle", 30, "the given-back node idle")
        progress = state / "progress.json"
        wait_until(progress.exists, 60, "training")
        done = json.loads(progress.read_text())["samples_done"]
        wait_until(lambda: json.loads(progress.read_text())["samples_done"] > done, 60, "training goes on")
        assert f"gives {released[0]} back to Slurm" in log.read_text()
        assert not list(
            Path(REPO).glob("slurm_job_*_resize.*")
        )  # scontrol's resize scripts not in the job's cwd
    finally:
        slurm.cmd("scancel", job_id, check=False)


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


def test_the_give_back_reads_the_allocations_nodes_again_before_it_shrinks(slurm):
    """Two spares decide in the same check; the first shrinks the allocation, so the second's list of the
    nodes to keep is stale (a node list naming a node no longer in the job is refused): it is read again
    right before the shrink. Here the list this node decided on names a node the job does not hold.
    (A second shrink of one allocation is refused by this test cluster, which has no accounting storage:
    "the DB index is being set", tried again until the give-back's limit.)"""
    from elastic_rm.launch.slurm_release import AllocationRelease

    r = slurm.cmd(
        "sbatch", "--parsable", "-N", "3", "-J", "fixed", "--output=/dev/null", "--wrap", "sleep 300"
    )
    job_id = r.stdout.strip().split(";")[0]

    def nodes() -> list[str]:
        listed = slurm.cmd("squeue", "-h", "-j", job_id, "-o", "%N %T").stdout.split()
        if listed[1:] != ["RUNNING"]:
            return []
        return slurm.cmd("scontrol", "show", "hostnames", listed[0]).stdout.split()

    wait_until(lambda: len(nodes()) == 3, 30, "the allocation of 3 nodes")
    first, second, third = nodes()
    release = AllocationRelease(None, None, second, job_id, second)
    release.keep = [first, "b99"]  # stale: decided on a list that no longer holds
    with pytest.MonkeyPatch.context() as mp:  # scontrol and squeue of the test cluster
        for key, value in slurm.env().items():
            mp.setenv(key, value)
        release.give_back(limit_s=20)
    assert nodes() == [first, third] and release.keep == [first, third]
