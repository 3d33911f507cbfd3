"""How many threads each worker uses: from the node's CPU share, not the machine's cores.

torch sizes its intra-op pool (and OpenMP) to every core of the machine unless ``OMP_NUM_THREADS`` says
otherwise, and torchrun sets it (to 1) only for more than one worker per node. Several nodes on one machine
then each run as many threads as there are cores: they oversubscribe the CPU and a scale-up measures as a
loss. The agent sets ``OMP_NUM_THREADS`` for its workers from the node's share: ``--cpu-limit``, else the
usable cores divided by the nodes of the run on this machine (their node-memory claims,
elastic_rm.checkpoint.owners), divided by the workers per node. A user's own ``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..obs.events import EventLog

ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # per worker
    cpu_share: float  # cores this node may use
    why: str  # where the share comes from, for the log


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a pinned node sees its pins)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose(nproc: int, cpu_limit: float | None, nodes_here: int, cores: int) -> ThreadChoice:
    """Threads per worker for ``nproc`` workers of a node; pure."""
    if nproc < 1:
        raise ValueError(f"a node runs at least one worker, got {nproc}")
    if cpu_limit is not None:
        share, why = cpu_limit, f"--cpu-limit {cpu_limit:g}"
    elif nodes_here > 1:
        share, why = cores / nodes_here, f"{cores} cores / {nodes_here} nodes of the run on this machine"
    else:
        share, why = float(cores), f"{cores} cores"
    return ThreadChoice(max(1, math.floor(share / nproc)), share, why)


def set_worker_env(
    run_dir: Path, nproc: int, cpu_limit: float | None, events: EventLog, node: str, said: int | None
) -> int:
    """Choose for this node, set OMP_NUM_THREADS in this process's environment (workers inherit it) and
    say so in the event log when it differs from ``said``; the threads per worker. The nodes here are the
    run's live node-memory claims on this machine (each agent makes one)."""
    from ..checkpoint.owners import live_owners

    choice = choose(nproc, cpu_limit, len(live_owners(run_dir)) or 1, usable_cores())
    os.environ[ENV] = str(choice.threads)
    if choice.threads != said:
        text = message(node, nproc, choice)
        events.emit("node", text, threads=choice.threads, cpu_share=round(choice.cpu_share, 3))
    return choice.threads


def message(node: str, nproc: int, choice: ThreadChoice) -> str:
    return (
        f"node {node}: {ENV}={choice.threads} for each of its {nproc} worker(s) "
        f"(CPU share {choice.cpu_share:g} cores: {choice.why}); set {ENV} yourself to choose"
    )
