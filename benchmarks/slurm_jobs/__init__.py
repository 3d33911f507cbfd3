"""Many jobs on one Slurm cluster: static allocations against `erm launch --slurm`, live.

The same arrival trace (``trace.py``: 12 jobs over 10 minutes, mixed sizing) runs on a local Slurm of 8
nodes (the fixture of tests/slurm: one slurmctld, 8 slurmd, munge) under two policies:

- static: each job is ``sbatch -N k`` whose batch script runs ``srun ermrun --nnodes k:k``, as users run
  torchrun: it waits until k nodes are free and keeps them to its end;
- elastic: each job is ``erm launch --slurm --call-in --nnodes 1:8 --job job.json`` (the planner, the job's
  request as its cold start): one one-node Slurm job per node, grown and given back as the planner
  decides, with the run's ``queue`` key read from squeue; a job that started short lends its nodes to a
  later one that fits on them (``--no-call-in``: without it).

Both policies run at the same time, each on a cluster and an etcd of its own (so the machine's background
load hurts both alike and the comparison takes the trace's time once); ``--rounds N`` repeats it with the
clusters swapped. From the elastic runs' events it also breaks down each give-back to a queue: the queue
key above 0, the leader's smaller demand, the launcher's stop of the node, its job's end. The workload is
examples/emulated/train.py: a job's step time follows its speed-up curve in sleep, so 16 nodes fit on 2
cores. Measured per job: JCT (its
arrival to its end), queueing (arrival to its first step), node-seconds held (sampled from squeue every
second); per job the ratio of its JCT under erm launch to its JCT under static. What a ratio is made of is
recorded beside it: per job and policy its nodes over time, the pauses between its steps, the jobs it
waited for and the order the jobs started in (a later job that started first overtook it: Slurm's
backfill, or erm launch starting a job on fewer nodes than it asked for), and per erm launch job its
rounds with their pauses, its demands and its launcher's actions. ``erm simulate`` runs the same trace
(time scaled, curves as ground truth) for the simulator's figure beside it.
Targets: live mean JCT <= 0.8x static, no job above 1.10x.
"""
