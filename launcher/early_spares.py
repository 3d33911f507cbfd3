"""ermrun's warm spares, started first thing: before ermrun's own imports (torch, the agent).

Why: a node that joins a running job (a scale-up, a Slurm node job) waits for its warm spares before it
joins the rendezvous, and the agent used to start them only once its own imports were done: two imports
of torch in a row on the scale-up's critical path. Started here, the spares import torch while ermrun
does, and the agent's pool adopts them (``SparePool.adopt``) instead of starting its own.

ermrun's flags are parsed by torch's parser, which needs torch: this module reads the few it needs from
the command line by hand (a guess). The agent checks the guess against its real worker command: a spare
that does not fit (another preload, another command, more than the node's workers) is stopped by its
pid, and every spare not adopted is stopped by its pid when ermrun ends, however it ends. A spare whose
ermrun is killed (SIGKILL) reads end-of-file on its socket once its imports are done and exits. A SIGTERM
before ermrun starts anything else (its imports, its parser) stops the spares and exits 0, as a node
stopped before its workers started does later on (a Slurm node job then ends COMPLETED, not FAILED).

No early spares where the agent would start them in a way this guess cannot see: ``--spares off``,
``--no-python``, ``--run-path``, NUMA binding, a worker Python other than ermrun's (``PYTHON_EXEC``),
a node count of workers that is not a number (``--nproc-per-node auto``), or ``--cpu-limit`` and
``--memory-limit`` (the agent's node cgroup and pinning hold the spares it starts; these would escape).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from elastic_rm.agent.malloc import set_worker_arenas
from elastic_rm.agent.spare_process import Spare

# torchrun's and ermrun's flags that take no value; every other flag before the script takes one
BOOLEAN_FLAGS = frozenset(
    (
        "-h",
        "--help",
        "-m",
        "--module",
        "--standalone",
        "--no-python",
        "--run-path",
        "--virtual-local-rank",
        "--slurm-release",
        "--quiet",
    )
)
NO_EARLY_START = (
    "-h",
    "--help",
    "--no-python",
    "--run-path",
    "--numa-binding",
    "--cpu-limit",
    "--memory-limit",
)
ENV_NO_EARLY_START = ("PET_NO_PYTHON", "PET_RUN_PATH", "PET_NUMA_BINDING", "PYTHON_EXEC")
# the long flags read here, which argparse also takes abbreviated (``--cpu 0.5`` is ``--cpu-limit 0.5``)
READ_FLAGS = frozenset(
    f
    for f in (
        *BOOLEAN_FLAGS,
        *NO_EARLY_START,
        "--nproc-per-node",
        "--spares",
        "--spare-preload",
        "--malloc-arenas",
    )
    if f.startswith("--")
)


def _unabbreviated(name: str) -> str:
    """``name`` spelled out when it abbreviates exactly one flag read here, as argparse reads it: ``--cpu``
    was taken for a flag of its own, the early spares started outside the node cgroup that ``--cpu-limit``
    makes, and the agent adopted them (its workers escaped the quota); ``--malloc 4`` left the spares at
    one malloc arena. An abbreviation argparse finds ambiguous fails ermrun anyway."""
    if not name.startswith("--") or len(name) < 3 or name in READ_FLAGS:
        return name
    matches = [f for f in READ_FLAGS if f.startswith(name)]
    return matches[0] if len(matches) == 1 else name


def read_flags(argv: Sequence[str]) -> tuple[dict[str, str | bool], list[str]]:
    """The flags before the training script (``--a_b`` spelled ``--a-b``) and the script with its
    arguments."""
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            return flags, list(argv[i:])
        name, eq, value = token.partition("=")
        if name.startswith("--"):
            name = _unabbreviated("--" + name[2:].replace("_", "-"))
        if name in BOOLEAN_FLAGS:
            flags[name] = True
            i += 1
        elif eq:
            flags[name] = value
            i += 1
        else:
            flags[name] = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
    return flags, []


def plan(argv: Sequence[str], env: Mapping[str, str]) -> tuple[int, tuple[str, ...], tuple[str, ...]] | None:
    """(count, modules, worker command label) of the spares to start now; None: none. Pure."""
    flags, script = read_flags(argv)
    if not script or any(f in flags for f in NO_EARLY_START) or flags.get("--spares") == "off":
        return None
    if any(env.get(name) for name in ENV_NO_EARLY_START):
        return None
    nproc = str(flags.get("--nproc-per-node") or env.get("PET_NPROC_PER_NODE") or "1")
    if not nproc.isdigit() or int(nproc) < 1:
        return None
    preload = flags.get("--spare-preload", "torch")
    modules = tuple(n.strip() for n in str(preload).split(",") if n.strip())
    if not modules:
        return None
    label = ("-m", *script) if flags.get("--module") or flags.get("-m") else tuple(script)
    return int(nproc), modules, label


def malloc_arenas(argv: Sequence[str]) -> int | None:
    """--malloc-arenas as given (default 1); None when it is not a number (ermrun's parser says so)."""
    flags, _ = read_flags(argv)
    value = str(flags.get("--malloc-arenas", "1"))
    return int(value) if value.isdigit() else None


class EarlySpares:
    """The spares ermrun started before its imports, until the agent adopts them or ermrun ends; and
    what a SIGTERM does until ermrun starts anything else (``release_sigterm``): stop them by their pid
    and exit 0, as a node stopped before its workers started does later (nothing else runs yet)."""

    def __init__(self, spares: list[Spare], handle_sigterm: bool = False) -> None:
        self.spares = spares
        self.started_at = time.time()  # ermrun's first line, for the node's start-up breakdown
        self._handling = handle_sigterm
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm) if handle_sigterm else None

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str] | None = None) -> EarlySpares:
        env = os.environ if env is None else env
        planned = plan(argv, env)
        arenas = malloc_arenas(argv)
        if planned is None or arenas is None:
            return cls([], handle_sigterm=True)
        count, modules, label = planned
        set_worker_arenas(arenas)  # glibc reads it when a spare starts: the agent sets the same later
        return cls(
            [Spare(modules, low_priority=False, label=label) for _ in range(count)], handle_sigterm=True
        )

    def pids(self) -> list[int]:
        return [s.pid for s in self.spares]

    def hand_over(self) -> list[Spare]:
        """The spares, for the agent's pool (ermrun no longer stops them); SIGTERM is ermrun's again."""
        spares, self.spares = self.spares, []
        self._restore_sigterm()
        return spares

    def release_sigterm(self) -> None:
        """ermrun installs its own SIGTERM handler now (the spares are still stopped at its end)."""
        self._restore_sigterm()

    def stop(self) -> None:
        """Stop every spare not handed over, by its pid."""
        spares, self.spares = self.spares, []
        for spare in spares:
            spare.kill()
        self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._handling:
            self._handling = False
            signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame) -> None:
        self.stop()
        print(
            "ermrun: stopped by SIGTERM during its start-up, before its workers started; the run goes on "
            "without this node",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0)  # not a failure (a Slurm node job ends COMPLETED); only the spares ran, now stopped
