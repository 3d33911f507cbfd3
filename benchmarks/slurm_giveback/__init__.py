"""A grown run gives a node back to a job that waits: the path's latency, live on a local Slurm.

One `erm launch --slurm` run of the emulated workload asks for 1 node and grows past its request on an
idle cluster of 4 (its curve makes nodes past the first worth 20% to 50% of an average node: above the
planner's bar for lent nodes, below its bar while others wait). Then another user's 2-node job arrives
and waits. From the run's events: that job's ``sbatch``, the launcher's ``queue`` event (squeue's refresh
and the queue key), the leader's smaller ``demand``, the launcher's ``stop`` of a node the round no longer
uses (its drain), that node job's end (``stopped``), and the waiting job running in squeue. Repeated
``--repeat`` times on fresh runs; writes benchmarks/results/slurm-giveback.json.
"""
