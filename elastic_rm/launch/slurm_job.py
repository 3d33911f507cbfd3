"""What `erm launch --slurm` submits for each node: sbatch's options and the batch script that runs ermrun."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

# A node job past the run's request runs at this Slurm nice value: the scheduler starts every other
# pending job of the partition first (priority/basic and priority/multifactor both subtract it; a
# positive nice needs no admin rights).
GROWTH_NICE = 10000
GROWTH_MARK = "; past its request"  # ends the comment of such a node job


@dataclass(frozen=True)
class SlurmOptions:
    run_id: str
    partition: str | None  # None: Slurm's default partition
    sbatch_args: tuple[str, ...]  # --slurm-arg, as typed (e.g. --time=2:00:00, --gres=gpu:8)
    exclude: tuple[str, ...]  # hosts never to use
    output: str  # the node job's --output pattern
    workdir: str
    python: str
    ermrun_flags: tuple[str, ...]  # the user's ermrun flags, without --node-id
    script: tuple[str, ...]  # the training script (or module) and its arguments
    env: tuple[tuple[str, str], ...] = ()
    pending_report_s: float = 60.0
    # the job description's requested nodes (None: no description or no request): what the run asks for
    # before its leader's first demand, as the planner's cold start does, instead of --nnodes MAX
    requested_nodes: int | None = None
    # lend the nodes of a short start to a job that arrives later (elastic_rm.launch.slurm_call_in)
    call_in: bool = False

    @property
    def job_name(self) -> str:
        return f"erm-{self.run_id}"

    @property
    def comment(self) -> str:
        return f"erm launch run {self.run_id}"

    @property
    def growth_comment(self) -> str:
        return self.comment + GROWTH_MARK

    def owns(self, name: str, comment: str) -> bool:
        """Whether a Slurm job of that name and comment is one of this run's node jobs (growth included)."""
        return name == self.job_name and comment in (self.comment, self.growth_comment)

    def batch_script(self) -> str:
        """The batch script: ermrun, exec'ed so that the job's batch signal reaches it, with the Slurm
        node's name as its node id."""
        env = {**dict(self.env), "ERM_SLURM": "0", "PYTHONUNBUFFERED": "1"}
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        command = " ".join(shlex.quote(a) for a in (self.python, "-m", "launcher.ermrun", *self.ermrun_flags))
        script = " ".join(shlex.quote(a) for a in self.script)
        return (
            "#!/bin/sh\n"
            f"cd {shlex.quote(self.workdir)} || exit 1\n"
            f'exec env {assigns} ERM_LAUNCH_HOST="$SLURMD_NODENAME" {command} '
            f'--node-id "$SLURMD_NODENAME" {script}\n'
        )

    def sbatch_options(self, exclude: list[str], growth: bool = False) -> list[str]:
        """A node job's options; ``growth``: a node past the run's request, which other jobs go before."""
        opts = [
            "--nodes=1",
            "--ntasks=1",
            "--exclusive",
            "--no-requeue",
            f"--job-name={self.job_name}",
            f"--comment={self.growth_comment if growth else self.comment}",
            f"--output={self.output}",
            f"--chdir={self.workdir}",
        ]
        if growth:
            opts.append(f"--nice={GROWTH_NICE}")
        if self.partition:
            opts.append(f"--partition={self.partition}")
        hosts = sorted(set(self.exclude) | set(exclude))
        if hosts:
            opts.append(f"--exclude={','.join(hosts)}")
        return [*opts, *self.sbatch_args]
