"""Which pending job, if any, may call in the nodes of a run that started short (`erm launch --slurm
--call-in`).

Why: a static job waits until all of its nodes are free; an elastic run starts on the nodes that are free
(at least --nnodes' minimum) and asks Slurm for the rest. When the cluster is busy, such a run starts short
and holds its few nodes, and a job that arrived after it, which static's backfill would have started on
those nodes while the run waited for all of its own, now waits, often for minutes. With the call-in, the
run that started short lends its nodes to the jobs that arrived after it: when one of them would start at once
on the idle nodes plus the run's, the run stops as many of its nodes as that job needs (it goes on
without them as after a lost node, or, when it needs them all, resumes from its checkpoint later),
holds its pending node jobs back in their place, lets that job take the nodes, and asks Slurm for its
nodes again once that job is no longer pending. At most once per run.

The rule here is pure (squeue's jobs in, a decision out); elastic_rm.launch.slurm_nodes acts on it.
Slurm starts pending jobs in priority order, which for jobs of equal priority is the order of their
job ids: a caller gets the freed nodes only after the older pending jobs took theirs, so they count
against the fit too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .slurm_cli import SlurmJob


@dataclass(frozen=True)
class PendingDemand:
    """The nodes one job waits for: a plain Slurm job, or another erm run's node jobs (one one-node job
    per node, named erm-<run id>) counted as one job of that many nodes."""

    key: str  # the erm run's job name, else the job's id
    first: int  # its oldest job id still in squeue, running or pending: when it arrived
    job_ids: frozenset[str]  # its pending jobs
    nodes: int


def job_number(job_id: str) -> int:
    """Slurm's job id as a number (an array task's ``123_4`` is its array job's 123): ids grow with
    submission, so they order the jobs by arrival without reading anyone's clock."""
    digits = job_id.split("_", 1)[0]
    return int(digits) if digits.isdigit() else 0


def erm_run_key(job: SlurmJob) -> str | None:
    """The run an erm launch node job belongs to (its job name), None for any other job."""
    if job.name.startswith("erm-") and job.comment.startswith("erm launch run "):
        return job.name
    return None


def pending_demands(waiting: Iterable[SlurmJob], live: Iterable[SlurmJob]) -> list[PendingDemand]:
    """The jobs that wait for nodes (``waiting``: other jobs' pending node demand, already filtered for
    partition and reason), grouped per job, oldest first. ``live``: every job squeue lists, which dates
    an erm run by its oldest node job (a run that had a node before it is not a later arrival)."""
    oldest: dict[str, int] = {}
    for job in live:
        key = erm_run_key(job)
        if key is not None and not job.ended:
            number = job_number(job.job_id)
            oldest[key] = min(oldest.get(key, number), number)
    groups: dict[str, tuple[int, set[str], int]] = {}
    for job in waiting:
        key = erm_run_key(job) or job.job_id
        number = job_number(job.job_id)
        first, ids, nodes = groups.get(key, (oldest.get(key, number), set(), 0))
        ids.add(job.job_id)
        groups[key] = (min(first, number), ids, nodes + job.node_count * job.array_tasks)
    demands = [PendingDemand(k, first, frozenset(ids), n) for k, (first, ids, n) in groups.items()]
    return sorted(demands, key=lambda d: (d.first, d.key))


@dataclass(frozen=True)
class CallIn:
    """A job that calls in the run's nodes, and how many of them it needs (the run keeps the rest)."""

    caller: PendingDemand
    nodes: int


def choose_caller(demands: list[PendingDemand], arrived_after: int, idle: int, running: int) -> CallIn | None:
    """The oldest job that arrived after ``arrived_after`` (the run's oldest node job id) and would start
    once some of the run's ``running`` nodes are free: the nodes it and every older pending job ask for
    are more than the ``idle`` nodes (else it starts without them) and at most the idle nodes plus the
    run's. It needs the difference of the run's nodes. None when no job is such."""
    ahead = 0
    for demand in demands:
        wanted = ahead + demand.nodes
        if demand.first > arrived_after and idle < wanted <= idle + running:
            return CallIn(demand, wanted - idle)
        ahead = wanted
    return None
