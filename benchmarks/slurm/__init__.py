"""How fast `erm launch --slurm` follows a decision, on a local Slurm (one slurmctld, N slurmd, munge).

- scale-up: the leader's demand grows by one (written to ``demand`` as the leader writes it); measured
  until the new node trains at the larger world, with the breakdown decision -> sbatch -> Slurm starts the
  job -> ermrun up (its first event) -> first step at the new size. Baseline in the same run: the same
  scale-ups with ermrun started directly on this machine (no Slurm), as a hostfile executor would;
- release: the planner's cold start wants 2 of the 4 node jobs running; measured from the launcher's
  decision to release a node (its ``stop`` event: SIGTERM to ermrun) to the node idle in ``sinfo``, and to
  the job gone from squeue as the launcher sees it. (The planner's own decision reaches the launcher at
  its next poll once the round leaves the node out.)

The workload is tests/launch/worker.py (a gloo loop, 20 ms steps) for the scale-up and the emulated job
(examples/emulated) for the release. Targets: scale-up <= 3 s, release <= 2 s on an idle cluster.
"""
