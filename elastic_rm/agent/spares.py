"""Warm spare worker processes: a round's workers start from processes that already imported torch.

Why: every round of a script that does not keep its processes (``elastic_rm.train.rounds``) starts new
workers, and Python's start plus ``import torch, torchrec`` is most of a round's downtime on a small
node. While a round trains, the agent keeps one spare per local rank (:mod:`elastic_rm.agent.spare`:
imports done on a thread at nice 19, waiting for a round); the next round hands each spare torch's
worker environment and argv, and the spare runs the script with ``runpy``. A node that joins a running
job starts its spares while it waits in the rendezvous (at normal priority: nothing trains there yet);
``ermrun`` starts them even earlier, first thing, so that they import torch while ermrun itself does
(launcher.early_spares), and the pool adopts them (:meth:`SparePool.adopt`).

torch's semantics stay: the workers are ``SubprocessHandler``s in a ``SubprocessContext`` (the same
``WorkerGroup``, ``RunResult``, redirects, tee and error files); only the ``Popen`` of a rank that gets a
spare is the spare's. A rank without a usable spare (dead, or still warming at low priority) gets a new
process as under torch. Spares apply to ``python -u script.py`` and ``python -u -m module`` workers
(what torchrun starts); ``--no-python`` commands, function entrypoints and NUMA binding start as usual.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from string import Template
from typing import Any

import psutil
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.multiprocessing.subprocess_handler.handlers import get_subprocess_handler
from torch.distributed.elastic.utils import macros

from ..guard import Watchdog
from ..obs.events import EventLog
from .channel import pid_alive
from .spare_process import Spare

log = logging.getLogger(__name__)

WARM_LIMIT_S = 120.0  # how long a node that runs no workers yet waits for its spares before it joins
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_preload(text: str) -> tuple[str, ...]:
    """``--spare-preload torch,torchrec``: module names, each importable here (ValueError says which)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not _MODULE.match(name):
            raise ValueError(
                f"--spare-preload: {name!r} is not a module name; give dotted module names separated by "
                "commas, e.g. torch,torchrec"
            )
        if importlib.util.find_spec(name.split(".")[0]) is None:
            raise ValueError(
                f"--spare-preload: module {name!r} is not installed for {sys.executable}; install it or "
                "drop it from the list"
            )
    return names


def why_unsupported(spec: WorkerSpec) -> str | None:
    """None when this worker spec can start from spares; else why not."""
    if not isinstance(spec.entrypoint, str) or os.path.realpath(spec.entrypoint) != os.path.realpath(
        sys.executable
    ):
        return "the workers are not this Python (--no-python or a function entrypoint)"
    args = [str(a) for a in spec.args]
    if len(args) < 2 or args[0] != "-u" or (args[1] == "-m" and len(args) < 3):
        return f"the worker command is not `python -u script.py` or `python -u -m module`: {args[:3]}"
    if spec.numa_options is not None:
        return "NUMA binding wraps the worker command"
    return None


class SparePool:
    """The node's spares: started ahead of rounds, taken by them, ended with the agent (and its Watchdog)."""

    def __init__(self, modules: tuple[str, ...], guard: Watchdog, label: tuple[str, ...] = ()) -> None:
        self.modules = modules
        self.label = label
        self._guard = guard
        self._spares: list[Spare] = []
        self.used_pids: list[int] = []  # spares that became workers, newest last
        self._adopted: list[int] = []  # adopted spares that no rendezvous has waited for yet
        self.closed = False

    def adopt(self, spares: list[Spare], count: int) -> list[int]:
        """Take over spares started before the agent (ermrun starts them first thing: launcher.early_spares):
        up to ``count`` live ones that import this pool's modules for this pool's worker command. The others
        are stopped by their pid. The pids adopted."""
        kept: list[Spare] = []
        for spare in spares:
            fits = spare.modules == self.modules and spare.label == self.label
            if not self.closed and fits and spare.alive() and len(self._spares) + len(kept) < count:
                kept.append(spare)
            else:
                spare.kill()
        pids = [s.pid for s in kept]
        if kept:
            self._spares.extend(kept)
            self._guard.watch(pids)  # from now on they end with the agent, as the spares it starts
            self._adopted.extend(pids)
            log.info("adopted %d spare worker process(es) %s started before the agent", len(pids), pids)
        return pids

    def take_adopted(self) -> list[int]:
        """The adopted spares that no rendezvous has waited for yet (a node joins once they are warm)."""
        adopted, self._adopted = self._adopted, []
        return [pid for pid in adopted if pid in self.pids()]

    def fill(self, count: int, low_priority: bool) -> list[int]:
        """Start spares until ``count`` live ones wait; the pids started."""
        if self.closed:
            return []
        for dead in [s for s in self._spares if not s.alive()]:
            dead.kill()  # reaps it and closes its socket
            self._spares.remove(dead)
        started = [Spare(self.modules, low_priority, self.label) for _ in range(count - len(self._spares))]
        if started:
            self._spares.extend(started)
            self._guard.watch([s.pid for s in started])  # a spare never outlives its agent
            log.info(
                "started %d spare worker process(es) %s (%s priority)",
                len(started),
                [s.pid for s in started],
                "low" if low_priority else "normal",
            )
        return [s.pid for s in started]

    def take(self) -> Spare | None:
        """A spare for one rank: a ready one first, else one warming at normal priority (ahead of a new
        process anyway); one still warming at nice 19 is left for the next round."""
        for usable in (Spare.ready, lambda s: not s.low_priority):
            for spare in self._spares:
                if spare.alive() and usable(spare):
                    self._spares.remove(spare)
                    self.used_pids.append(spare.pid)
                    return spare
        return None

    def wait_ready(self, timeout_s: float) -> bool:
        """Until every waiting spare finished its imports (False: one died, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spares = list(self._spares)
            if any(not s.alive() for s in spares):
                return False
            if all(s.ready() for s in spares):
                return True
            time.sleep(0.05)
        return False

    def pids(self) -> list[int]:
        """The waiting spares (also read by the metrics thread: a snapshot of the list, never mutated)."""
        return [s.pid for s in list(self._spares) if s.alive()]

    def usage(self) -> tuple[int, int]:
        """(count, resident memory) of the waiting spares, for the metrics record."""
        return len(self.pids()), self.rss_bytes()

    def rss_bytes(self) -> int:
        """Resident memory of the waiting spares (what keeping them costs)."""
        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def close(self) -> None:
        self.closed = True
        for spare in self._spares:
            spare.kill()
        self._spares = []


class _SpareHandler(SubprocessHandler):
    """torch's handler of one worker, whose process is a spare's instead of a new ``Popen``."""

    def __init__(self, spare: Spare, **kwargs: Any) -> None:
        self._spare = spare
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        try:
            self._spare.hand(list(args[2:]), env, self._stdout, self._stderr)  # args: python -u ...
        except OSError as exc:  # it died between take() and now: a new process, as torch would
            log.warning("spare pid %d unusable (%s); starting a new worker process", self._spare.pid, exc)
            self._spare.kill()
            return super()._popen(args, env)
        return self._spare.proc


class SpareContext(SubprocessContext):
    """torch's ``SubprocessContext`` whose ranks start from spares where there is one."""

    def __init__(self, pool: SparePool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool = pool
        self.from_spares: dict[int, int] = {}  # local rank -> pid of the spare it runs in

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the workers were started already")
        for rank in range(self.nprocs):
            options = dict(
                entrypoint=self.entrypoint,
                args=self.args[rank],
                env=self.envs[rank],
                stdout=self.stdouts[rank],
                stderr=self.stderrs[rank],
                local_rank_id=rank,
                numa_options=self._numa_options,
            )
            spare = self._pool.take()
            if spare is None:
                self.subprocess_handlers[rank] = get_subprocess_handler(**options)
                continue
            handler = _SpareHandler(spare, **options)
            self.subprocess_handlers[rank] = handler
            if handler.proc is spare.proc:
                self.from_spares[rank] = spare.pid


def worker_envs(
    agent: LocalElasticAgent, worker_group: WorkerGroup
) -> tuple[dict[int, tuple], dict[int, dict[str, str]], Any]:
    """The args, environments and log prefixes of torch's ``LocalElasticAgent._start_workers`` (torch
    2.13, pinned by tests/e2e/test_torch_contract.py), line for line, without its side effects."""
    spec = worker_group.spec
    restart_count = spec.max_restarts - agent._remaining_restarts
    use_agent_store: bool = spec.rdzv_handler.use_agent_store
    args: dict[int, tuple] = {}
    envs: dict[int, dict[str, str]] = {}
    prefixes: dict[int, str] | None = {} if agent._log_line_prefix_template else None
    for worker in worker_group.workers:
        local_rank = worker.local_rank
        worker_env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": worker_group.master_addr,
            "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)),
        }
        agent._set_local_rank_env(worker_env, local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            worker_env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        if prefixes is not None:
            prefixes[local_rank] = Template(agent._log_line_prefix_template).safe_substitute(
                role_name=spec.role, rank=worker.global_rank, local_rank=local_rank
            )
        envs[local_rank] = worker_env
        args[local_rank] = tuple(macros.substitute(list(spec.args), str(local_rank)))
    return args, envs, prefixes


def start_workers(
    agent: LocalElasticAgent, worker_group: WorkerGroup, pool: SparePool, given: tuple | None = None
) -> SpareContext:
    """torch's ``_start_workers`` with :class:`SpareContext` in place of ``start_processes``.
    ``given``: the (args, environments, prefixes) to start with, else :func:`worker_envs`'."""
    spec = worker_group.spec
    args, envs, prefixes = given or worker_envs(agent, worker_group)
    agent._setup_local_watchdog(envs=envs)
    agent._setup_healthcheck()
    if spec.entrypoint is None or agent._logs_specs is None:
        raise AssertionError
    context = SpareContext(
        pool,
        name=spec.role,
        entrypoint=spec.entrypoint,
        args=args,
        envs=envs,
        logs_specs=agent._logs_specs,
        log_line_prefixes=prefixes,
        numa_options=spec.numa_options,
        duplicate_stdout_filters=spec.duplicate_stdout_filters,
        duplicate_stderr_filters=spec.duplicate_stderr_filters,
    )
    try:
        context.start()
    except Exception:
        context.close()
        raise
    return context


def spare_pool(
    preload: tuple[str, ...], spec: WorkerSpec, guard: Watchdog, events: EventLog
) -> SparePool | None:
    """The agent's pool, its spares importing ``preload`` (None: workers that cannot start from spares,
    said once)."""
    why = why_unsupported(spec)
    if why is not None:
        log.warning("no warm spare workers: %s", why)
        events.emit("node", f"no warm spare workers: {why}", spares=False, reason=why)
        return None
    return SparePool(preload, guard, label=tuple(str(a) for a in spec.args[1:]))


def start_from_spares(
    agent: LocalElasticAgent,
    worker_group: WorkerGroup,
    pool: SparePool,
    events: EventLog,
    round_id: int,
    started: Callable[[SpareContext], None],
) -> SpareContext:
    """The agent's ``_start_workers`` with spares: start the round, say which ranks got a spare, and
    warm the next round's spares at low priority; the workers' process context (torch's ``_pcontext``).

    ``started`` gets the context as soon as the workers run, before the spares are warmed: a signal or an
    error from then on finds the workers in the agent's hands, which stops them."""
    context = start_workers(agent, worker_group, pool)
    started(context)
    pids = context.pids()
    used = context.from_spares
    fresh = len(pids) - len(used)
    events.emit(
        "round",
        f"round {round_id}: {len(used)} worker(s) started from warm spares, {fresh} as new processes",
        round=round_id,
        from_spares={str(rank): pid for rank, pid in sorted(used.items())},
        new_processes=fresh,
    )
    pool.fill(worker_group.spec.local_world_size, low_priority=True)
    return context


def warm_before_joining(worker_group: WorkerGroup, pool: SparePool, events: EventLog) -> None:
    """Before a rendezvous: start the spares the next round needs. A node whose workers do not run (it
    is about to join a running job, or the job is starting) joins once they are warm: the running job
    trains meanwhile, and the round then waits for no import (a scale-up's critical path). Next to
    running workers (a round in place) they warm at nice 19 and the round does not wait."""
    running = any(pid_alive(w.id) for w in worker_group.workers if w.id is not None)
    early = pool.take_adopted()  # started before ermrun's own imports: mostly warm by now
    started = pool.fill(worker_group.spec.local_world_size, low_priority=running)
    if (started or early) and not running:
        t0 = time.monotonic()
        warm = pool.wait_ready(WARM_LIMIT_S)
        waited = time.monotonic() - t0
        log.info("spares %s after %.2fs; joining the rendezvous", "warm" if warm else "not warm", waited)
        events.emit(
            "node",
            f"{len(pool.pids())} spare worker(s) {'warm' if warm else 'still warming'} after {waited:.2f}s; "
            "joining the rendezvous",
            spares_warm=warm,
            waited_s=round(waited, 3),
            early_pids=early,  # spares ermrun started before its imports
        )
