"""The call-in's rule (elastic_rm.launch.slurm_call_in): which pending job may call in a short start's
nodes, from squeue's jobs alone. The executor acting on it runs against a real Slurm in
tests/slurm/test_slurm_call_in.py."""

from __future__ import annotations

from elastic_rm.launch.slurm_call_in import choose_caller, job_number, pending_demands
from elastic_rm.launch.slurm_cli import SlurmJob


def _job(
    job_id: str, state: str = "PENDING", name: str = "other", comment: str = "", nodes: int = 1, tasks=1
):
    return SlurmJob(job_id, name, comment, state, "", "Resources", ("debug",), nodes, "u", None, tasks)


def _run_job(job_id: str, run: str, state: str = "PENDING") -> SlurmJob:
    return _job(job_id, state, name=f"erm-{run}", comment=f"erm launch run {run}")


def test_job_ids_order_arrivals_and_an_array_task_is_its_array_job():
    assert job_number("120") < job_number("121")
    assert job_number("97_3") == 97 and job_number("97_[1-4]") == 97
    assert job_number("garbage") == 0


def test_an_erm_runs_node_jobs_are_one_job_dated_by_its_oldest():
    pending = [_run_job("30", "r"), _run_job("31", "r"), _job("25", nodes=2, tasks=2)]
    live = [*pending, _run_job("12", "r", state="RUNNING")]
    demands = pending_demands(pending, live)
    assert [(d.key, d.first, d.nodes) for d in demands] == [("erm-r", 12, 2), ("25", 25, 4)]
    assert demands[0].job_ids == {"30", "31"}


def test_the_first_later_job_that_fits_the_idle_and_lent_nodes_is_the_caller():
    demands = pending_demands([_job("10", nodes=2), _job("20", nodes=3)], [])
    # arrived after job 9: job 10's 2 nodes fit 0 idle + 2 lent
    call = choose_caller(demands, arrived_after=9, idle=0, running=2)
    assert call.caller.key == "10" and call.nodes == 2
    # job 10 arrived before the run's first round: it is served first, and job 20's 3 more do not fit
    assert choose_caller(demands, arrived_after=10, idle=0, running=2) is None
    # with room for both, job 20 is the caller: job 10, older, takes 2 first, job 20 needs 4 of the run's
    call = choose_caller(demands, arrived_after=10, idle=1, running=5)
    assert call.caller.key == "20" and call.nodes == 4


def test_a_job_that_starts_on_the_idle_nodes_alone_calls_nothing_in_and_a_caller_takes_what_it_needs():
    demands = pending_demands([_job("10", nodes=2)], [])
    assert choose_caller(demands, arrived_after=0, idle=2, running=3) is None
    call = choose_caller(demands, arrived_after=0, idle=1, running=3)  # one of the run's 3 is enough
    assert call.caller.key == "10" and call.nodes == 1
    assert choose_caller(demands, arrived_after=0, idle=0, running=1) is None  # 2 > 0 + 1
