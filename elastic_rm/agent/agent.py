"""``ElasticRMAgent``: torch's ``LocalElasticAgent`` plus what elastic-rm needs on each node.

What it adds:
- a resource monitor (CPU, memory, GPUs, per-worker RSS/CPU) and the workers' step times (a local
  channel, no etcd connection per worker), published once a second to ``metrics/<node>`` in etcd and on
  an optional HTTP endpoint (``/healthz``, Prometheus ``/metrics``);
- draining: before torch restarts healthy workers for a new round, workers that use
  ``elastic_rm.train.report`` are asked to stop at the next step boundary (after their final
  checkpoint hook) within a grace period; then torch stops whatever is left, as it always does;
- lost-peer handling: workers whose collectives fail because a member vanished move into the next round
  without using one of ``--max-restarts``: in place when they hold the failure (``with rnd:``,
  elastic_rm.agent.inplace), else restarted.

Extension points: ``_start_workers``, ``_monitor_workers``, ``_restart_workers`` and ``_exit_barrier``
are private torch methods (``_shutdown`` is not ours to hook: torch calls it on every worker stop);
``tests/e2e/test_torch_contract.py`` pins them so that a torch upgrade that changes them fails loudly
instead of silently skipping our hooks. The helpers (in-place rounds, prepared starts, `erm stop`) see the
agent through :class:`elastic_rm.agent.host.AgentHost`: its public members wrap what they need of torch's.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from ..background import Background
from ..checkpoint.node_memory import run_memory_dir
from ..guard import Watchdog
from ..obs.events import EventLog
from ..rendezvous.etcd_store import RoundSupersededError, RunClosedError
from ..rendezvous.services import WITHOUT_SERVICES, NodeServices
from ..wire.channel import ENV_ROUND
from ..wire.metrics import encode_record
from ..wire.records import RoundRecord
from . import ckpt_hooks, finish, stop, threads
from .channel import AgentChannel
from .host import WorkerStart
from .http import AgentHttpServer
from .inplace import InPlaceRounds
from .ledger_mirror import LedgerMirror
from .malloc import DEFAULT_ARENAS, set_worker_arenas
from .monitor import ResourceMonitor
from .node_events import emit_new_checkpoints, emit_sample
from .prepared import PreparedStart
from .record import build_record
from .restores import RestoreTracker
from .spares import (
    SpareContext,
    parse_preload,
    spare_pool,
    start_from_spares,
    start_workers,
    warm_before_joining,
    worker_envs,
)

log = logging.getLogger(__name__)

MAX_SUPERSEDED_ROUNDS = 10  # rounds in a row that may be superseded while their ranks are exchanged

# Step times are summarised over this window: long enough for a stable median, short enough that a node
# that turns slow shows within a few of the planner's samples (each of which is a fresh summary).
STEP_WINDOW_S = 10.0

PUBLISH_INTERVAL_S = 1.0  # etcd writes of metrics/<node>: at most once a second


@dataclass(frozen=True)
class AgentOptions:
    """elastic-rm's per-node options (``ermrun --help``, group "elastic-rm")."""

    node_id: str | None = None
    # Workers that fail while a member of their world vanishes are victims, not culprits: wait this long
    # for the new round before counting the failure against --max-restarts (None: the rendezvous lease
    # TTL + 1 s with the elastic-rm backend; 0 with torch's backends, which do not report lost nodes).
    membership_grace_s: float | None = None
    sample_interval_s: float = 1.0  # resource sampling period
    drain_grace_s: float = 30.0  # how long drained workers may take to reach a step boundary
    metrics_port: int | None = None  # HTTP /healthz and /metrics; None or 0: off
    metrics_host: str = "127.0.0.1"
    event_log: str | None = None  # also append the run's events (elastic_rm.obs.events) to this JSONL file
    event_sample_interval_s: float = 10.0  # a "sample" event (resources, throughput) this often; 0: none
    worker_threads: bool = False  # OMP_NUM_THREADS from the CPU share (agent/threads.py); ermrun: unless set
    cpu_limit: float | None = None  # --cpu-limit: this node's CPU share
    spares: bool = True  # keep one warm spare worker process per local rank (elastic_rm.agent.spares)
    spare_preload: tuple[str, ...] = ("torch",)  # what the spares import while they wait
    malloc_arenas: int = (
        DEFAULT_ARENAS  # MALLOC_ARENA_MAX of the workers and spares (agent/malloc.py); 0: glibc's
    )

    def validate(self) -> None:
        # written so that NaN fails too (NaN <= 0 is False): a NaN drain grace passed here and raised in
        # the drain at the job's end; an infinite sample interval killed the monitor's thread
        if not 0 < self.sample_interval_s < math.inf:
            raise ValueError(f"--sample-interval must be > 0 seconds, got {self.sample_interval_s}")
        if not self.drain_grace_s >= 0:
            raise ValueError(f"--drain-grace must be >= 0 seconds, got {self.drain_grace_s}")
        if self.membership_grace_s is not None and not self.membership_grace_s >= 0:
            raise ValueError(f"--membership-grace must be >= 0 seconds, got {self.membership_grace_s}")
        if not self.event_sample_interval_s >= 0:
            raise ValueError(
                f"--event-sample-interval must be >= 0 seconds (0: off), got {self.event_sample_interval_s}"
            )
        if self.malloc_arenas < 0:
            raise ValueError(f"--malloc-arenas must be >= 0 (0: glibc's default), got {self.malloc_arenas}")
        if self.spares:
            parse_preload(",".join(self.spare_preload))


class ElasticRMAgent(LocalElasticAgent):
    def __init__(
        self, *args: Any, services: NodeServices | None, options: AgentOptions | None = None, **kwargs: Any
    ):
        """``services``: None under torch's own backends; the agent then logs what it runs without."""
        super().__init__(*args, **kwargs)
        self.options = options or AgentOptions()
        self.options.validate()
        self._handler = self._worker_group.spec.rdzv_handler
        self._services = services
        self.node_id = services.node_id if services is not None else self.options.node_id or "node"
        self.node_ids_used = [self.node_id]  # each id this node had (a rejoin gets a new one): node memory
        if services is None:
            log.warning(
                "rendezvous backend %r has no elastic-rm node services; running without %s",
                self._handler.get_backend(),
                WITHOUT_SERVICES,
            )
        from ..obs.metrics import AgentMetrics

        self.metrics = AgentMetrics(self.node_id)
        run_id = self._handler.get_run_id()
        self.events = _open_event_log(run_id, self._services, self.node_id, self.options.event_log)
        self.http = AgentHttpServer(
            self.metrics, self.options.metrics_port, self.options.metrics_host, self._health
        )
        self.http.start()  # a port in use fails here, before any worker or thread exists
        # peers fetch and replicate flash checkpoints through it; published in this node's record
        self.ckpt_server = ckpt_hooks.start_for_agent(services, self._handler.get_run_id())
        self.monitor = ResourceMonitor(interval_s=self.options.sample_interval_s)
        if services is not None:  # the node record carries the GPUs (the planner's capacity)
            services.set_hardware(*self.monitor.gpu_inventory())
        self.channel = AgentChannel(window_s=STEP_WINDOW_S)
        self.in_place = InPlaceRounds(self.channel, self.events)  # workers that keep their processes
        self.restores = RestoreTracker(self.channel, self.events)  # "restore" events from the workers
        self.restores.expected = self._worker_group.spec.local_world_size
        self._publisher = Background(self._publish_loop, "erm-metrics")
        # workers run in sessions of their own: without it they would train on after this agent's death
        self._orphan_guard = Watchdog()
        self._orphan_guard.watch([], remove=[self.channel.directory])  # gone with the agent, SIGKILL included
        set_worker_arenas(self.options.malloc_arenas)  # before any spare or worker starts
        self.spares = (
            spare_pool(self.options.spare_preload, self._worker_group.spec, self._orphan_guard, self.events)
            if self.options.spares
            else None
        )
        self.prepared = PreparedStart(self, self.spares)  # a joining node's workers, started before the seal
        if services is not None:
            services.set_forming_round_hook(self.prepared.on_forming_round)
            self.in_place.on_capable = services.set_workers_in_place  # said in this node's record
        self._started = False
        self._threads: int | None = None  # the workers' thread count said in the event log
        self._closed = False
        self._next_sample = 0.0  # monotonic time of the next "sample" event
        self._last_checkpoint = 0  # the newest flash checkpoint step reported as a "checkpoint" event
        self._publish_errors: set[str] = set()  # metrics-loop errors already logged as warnings
        self.ledger_mirror = _ledger_mirror(run_id, self._services, self.node_id)
        self.last_record: dict[str, Any] | None = None  # the newest metrics record (ermrun's status line)
        self.stop_reason: str | None = None  # "erm stop" once `erm stop RUN` stopped the workers

    # -- read-only views (ermrun's status line) ---------------------------------------------------------

    @property
    def joined_round(self) -> RoundRecord | None:
        """The last round this node joined (None before the first, and under torch's own backends)."""
        return self._services.joined_round if self._services is not None else None

    @property
    def services(self) -> NodeServices | None:
        """What the rendezvous provides besides torch's API (None under torch's own backends)."""
        return self._services

    @property
    def worker_state(self) -> WorkerState:
        """torch's state of this node's worker group."""
        return self._worker_group.state

    def node_id_now(self) -> str:
        """This node's id now: it changes when the node rejoins after losing its lease."""
        return self._services.node_id if self._services is not None else self.node_id

    # -- what the helpers act on (elastic_rm.agent.host.AgentHost) ---------------------------------------

    @property
    def remaining_restarts(self) -> int:
        """torch's restarts left (``--max-restarts`` less those used)."""
        return self._remaining_restarts

    @property
    def process_context(self) -> PContext | None:
        """torch's process context of the running workers."""
        return self._pcontext

    @process_context.setter
    def process_context(self, context: PContext | None) -> None:
        self._pcontext = context

    def rendezvous(self, group: WorkerGroup) -> None:
        """torch's rendezvous and rank exchange for ``group`` (a round its workers join in place)."""
        self._rendezvous(group)

    def set_worker_environment(self, round_id: int) -> None:
        """What every start of this node's workers inherits from the agent's environment: the channel's
        directory, this node's id (the flash checkpoint keeps each node's copy under it), the round's
        checkpoint peers and id, and the workers' thread count."""
        self._start_side_services()
        os.environ.update(self.channel.env())
        os.environ["ERM_NODE_ID"] = node = self.node_id_now()
        if node not in self.node_ids_used:  # the workers' node memory goes under this id from now on
            self.node_ids_used.append(node)
        ckpt_hooks.set_worker_env(self._services)  # this round's peers' checkpoint servers
        os.environ[ENV_ROUND] = str(round_id)
        if self.options.worker_threads:  # OMP_NUM_THREADS from this node's CPU share
            run_dir = run_memory_dir(self._handler.get_run_id())
            nproc = self._worker_group.spec.local_world_size
            limit = self.options.cpu_limit
            self._threads = threads.set_worker_env(
                run_dir, nproc, limit, self.events, self.node_id, self._threads
            )

    def worker_start(self, group: WorkerGroup) -> WorkerStart:
        """What torch's ``_start_workers`` would give ``group``'s workers, without starting them."""
        return worker_envs(self, group)

    def start_workers_with(self, group: WorkerGroup, given: WorkerStart) -> SpareContext:
        """Start ``group``'s workers with ``given``, from the node's warm spares where there are some."""
        if self.spares is None:
            raise RuntimeError("no spare pool: the workers start as torch starts them")
        return start_workers(self, group, self.spares, given)

    def guard_processes(self, pids: list[int]) -> None:
        """End these processes with the agent, even when it is killed."""
        self._orphan_guard.watch(pids)

    def kill_workers(self) -> None:
        """torch's stop of the workers with SIGKILL, without its 30 s wait."""
        self._shutdown(death_sig=signal.SIGKILL, timeout=5)

    # -- life cycle -------------------------------------------------------------------------------------

    def _start_side_services(self) -> None:
        if self._started:
            return
        self._started = True
        self.channel.start()
        self.monitor.start()
        self._publisher.start()

    def close(self) -> None:
        """Stop what the agent started besides the workers (idempotent, bounded)."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._publisher.stop(timeout_s=5)
            self.monitor.stop()
            self.channel.close()
        self.http.stop()
        self.prepared.discard("the agent is closing")
        if self.spares is not None:
            self.spares.close()
        if self.ckpt_server is not None:
            self.ckpt_server.stop()
        self._orphan_guard.release()  # torch has stopped the workers by now

    def remove_on_exit(self, path: str, prune: tuple[str, ...] = ()) -> None:
        """Remove a file or directory, then ``prune``'s empty directories, at close() or after a SIGKILL."""
        self._orphan_guard.watch([], remove=[path], prune=list(prune))

    def _health(self) -> tuple[bool, dict[str, Any]]:
        state = self._worker_group.state
        ok = state not in (WorkerState.FAILED, WorkerState.UNKNOWN)
        return ok, {"node": self.node_id, "state": str(state.value)}

    # -- metrics ----------------------------------------------------------------------------------------

    def _publish_loop(self, stopping: threading.Event) -> None:
        while not stopping.wait(PUBLISH_INTERVAL_S):
            try:
                self._publish_once()
            except Exception as exc:  # noqa: BLE001 - metrics must never take the agent down
                if repr(exc) not in self._publish_errors:  # loudly once (a bug must not hide), then quietly
                    self._publish_errors.add(repr(exc))
                    log.warning("metrics publish failed: %r", exc, exc_info=True)
                else:
                    log.debug("metrics publish failed: %s", exc)

    def _publish_once(self) -> None:
        resources = self.monitor.summary()
        if resources is None:
            return
        spares = self.spares.usage() if self.spares is not None else None
        record = build_record(self.node_id, resources, self.channel.summary(), spares=spares)
        self.last_record = record
        self.metrics.update(record)
        self.metrics.add_steps(self.channel.steps_total)
        completed = self.joined_round
        if completed is not None:
            self.metrics.set_round(completed.round)
        self.metrics.set_state(str(self._worker_group.state.value).lower())
        if self._services is not None:
            self._services.publish_metrics(encode_record(record))
        self._note_checkpoints()
        self.restores.poll()
        if self.ledger_mirror is not None:
            mirrored = self.ledger_mirror.poll()
            if mirrored is not None:
                log.debug("ledger of step %d mirrored: %d samples done", mirrored.step, mirrored.samples_done)
        interval = self.options.event_sample_interval_s
        if interval > 0 and completed is not None and time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + interval
            emit_sample(self.events, self.node_id, record, completed)

    def _note_checkpoints(self) -> None:
        node_dir = run_memory_dir(self._handler.get_run_id()) / self.node_id_now()
        self._last_checkpoint = emit_new_checkpoints(self.events, node_dir, self._last_checkpoint)

    # -- torch hooks ------------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous and rank exchange, once more when a member died right after the round was
        sealed: the exchange then waits for the dead member in the round's store, a newer round (without
        it) ends that wait (RoundSupersededError), and this node joins the newer round (spares: first
        warm)."""
        if self.spares is not None:
            warm_before_joining(worker_group, self.spares, self.events)
        for attempt in range(1, MAX_SUPERSEDED_ROUNDS + 1):
            try:
                return super()._rendezvous(worker_group)
            except RunClosedError as exc:  # the others finished while we exchanged ranks: nothing to run
                raise RendezvousGracefulExitError(str(exc)) from None
            except RoundSupersededError as exc:
                if attempt == MAX_SUPERSEDED_ROUNDS:
                    raise
                log.warning("%s (attempt %d)", exc, attempt)
                self.events.emit("round", "round superseded during the rank exchange; joining the newer one")

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Workers inherit this process's environment: the channel's directory and this node's id
        (the flash checkpoint keeps each node's copy under its node id)."""
        joined = self.joined_round
        round_id = joined.round if joined is not None else 0
        self.set_worker_environment(round_id)
        self.channel.clear_drain()
        self.channel.reset_steps()  # a new world: step times of the old one would blur the planner's view
        pids = self.prepared.take(worker_group)  # workers started before the seal, if they fit it
        if pids is None and self.spares is None:
            pids = super()._start_workers(worker_group)
        elif pids is None:

            def started(context: SpareContext) -> None:
                self.process_context = context

            context = start_from_spares(self, worker_group, self.spares, self.events, round_id, started)
            pids = context.pids()
        self.monitor.set_pids(pids.values())
        self.guard_processes(list(pids.values()))  # they end with this agent, even by SIGKILL
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A new round while the workers are healthy: drain them at a step boundary first, when the new round
        keeps all our peers (a scale-up, a planned change). When a peer is gone, a worker waiting on it in a
        collective never reaches a step boundary: stop at once, as torch does."""
        # without node services nothing tells a lost peer apart: drain, as a planned change would
        keeps_peers = self._services.peers_all_kept() if self._services is not None else True
        held = self.in_place.waiting_s([w.id for w in worker_group.workers if w.id is not None]) is not None
        drain = (
            worker_group.state == WorkerState.HEALTHY
            and keeps_peers
            and not held
            and self.options.drain_grace_s > 0
            and self._started
        )
        if not drain and self._started and worker_group.state == WorkerState.HEALTHY:
            why = "a peer left (its collectives cannot finish)" if not keeps_peers else "--drain-grace 0"
            why, then = (
                ("the workers' round failed", "they wait in place") if held else (why, "stopping workers")
            )
            # held: the recovery's own line follows
            self.events.emit(
                "drain", f"drain skipped: {why}; {then}", skipped=True, reason=why, console=not held
            )
            self.restores.mark_change()  # the old workers' newest step; held workers then move in place:
            if (held or not keeps_peers) and self.in_place.run_after_loss(self, worker_group):
                return
        if drain:
            self.metrics.set_state("draining")
            t0 = time.monotonic()
            self.channel.request_drain()
            pids = [w.id for w in worker_group.workers if w.id is not None]
            result = self.channel.wait_for_acks(timeout_s=self.options.drain_grace_s, pids=pids)
            elapsed = time.monotonic() - t0
            log.info(
                "drained %d worker(s) at step boundaries in %.2fs (%d without the API, %d missing)",
                len(result.acked),
                elapsed,
                len(result.unregistered),
                len(result.missing),
            )
            steps = sorted(set(result.acked.values()))
            if result.missing:
                message = (
                    f"drain grace {self.options.drain_grace_s:g}s exceeded: {len(result.missing)} worker(s) "
                    "did not reach a step boundary; stopping them"
                )
            elif result.acked:
                message = f"drained {len(result.acked)} worker(s) at step {'/'.join(map(str, steps))}"
            else:
                message = "drain: no worker uses elastic_rm.train; stopping them"
            self.events.emit(
                "drain",
                message + f" in {elapsed:.2f}s",
                steps=steps,
                acked=len(result.acked),
                hook_failed=len(result.failed),
                missing=len(result.missing),
                unregistered=len(result.unregistered),
                elapsed_s=round(elapsed, 3),
                grace_exceeded=bool(result.missing),
            )
            self.restores.mark_change()  # after the drain: the old workers' last step is known
            if self.in_place.run(self, worker_group, result):
                return  # the workers moved into the new round in place (elastic_rm.agent.inplace)
        self.restores.mark_change()
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitor, except that a failure caused by a lost peer becomes a membership restart.

        When a member node dies, the survivors' collectives fail at once, long before its lease expires.
        torch would count that against --max-restarts (and, at 0, end the job). We wait up to the
        membership grace for the rendezvous to show a newer round; if it does, we report HEALTHY so that
        torch's loop sees ``num_nodes_waiting() > 0`` and re-rendezvous without using a restart.
        """
        if stop.requested(self._services):  # `erm stop RUN`: drain, then finish (elastic_rm.agent.stop)
            return stop.stop_workers(self, worker_group, self.options.drain_grace_s)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:  # workers that hold a failed round wait: in place, or fail
            return self.in_place.held_failure(self, worker_group, result, super()._monitor_workers)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = worker_group.spec.rdzv_handler
        grace = self.membership_grace()
        deadline, why = time.monotonic() + grace, f"membership grace {grace:g}s"
        while time.monotonic() < deadline:
            if handler.is_closed() or finish.others_finished(
                getattr(self, "_store", None), worker_group.group_world_size
            ):  # the job ends, not its membership
                why = "the run is closed" if handler.is_closed() else "the other nodes finished"
                break
            if handler.num_nodes_waiting() > 0:
                log.info("workers failed while the membership changed: re-rendezvous without using a restart")
                self.emit_failure(result, "the membership changed: re-rendezvous without using a restart")
                return RunResult(state=WorkerState.HEALTHY)
            time.sleep(0.05)
        left = self._remaining_restarts
        outcome = f"{left} restart(s) left" if left > 0 else "no restarts left"
        self.emit_failure(result, f"{outcome} ({why})")
        return result

    def _exit_barrier(self) -> None:
        """torch's exit barrier, ended when the run is closed rather than after ``exit_barrier_timeout``."""
        self._in_exit_barrier = True  # torch's health check: the agent is alive while it waits here
        try:
            world = self._worker_group.group_world_size
            finish.exit_barrier(self._store, world, self._exit_barrier_timeout, self.events)
        finally:
            self._in_exit_barrier = False

    def emit_failure(self, result: RunResult, outcome: str) -> None:
        """Say a failed worker group in the event log, with what follows (``outcome``)."""
        failures = sorted(result.failures.items())
        ranks = [rank for rank, _ in failures]
        codes = [f.exitcode for _, f in failures]
        state = str(result.state.value).lower()
        self.events.emit(
            "failure",
            f"worker group {state}: rank(s) {ranks} exit code(s) {codes}; {outcome}",
            state=state,
            ranks=ranks,
            exit_codes=codes,
            outcome=outcome,
        )

    def membership_grace(self) -> float:
        """--membership-grace; by default the lease TTL + 1 s. 0 without services (no lost-node reports)
        and in a world of this node alone: no peer's loss can have failed its workers."""
        if self.options.membership_grace_s is not None:
            return self.options.membership_grace_s
        joined = self.joined_round
        if self._services is None or (joined is not None and len(joined.members) <= 1):
            return 0.0
        return self._services.lease_ttl + 1.0


def _open_event_log(run_id: str, services: NodeServices | None, node_id: str, path: str | None) -> EventLog:
    """The run's event log in etcd (node services), else a local one (torch's backends); plus the
    ``--event-log`` file at ``path``."""
    events = services.events if services is not None else EventLog(run_id, node_id)
    if path:
        try:
            events.attach_file(path)
        except OSError as exc:
            raise ValueError(f"--event-log {path}: cannot append to it ({exc})") from exc
    return events


def _ledger_mirror(run_id: str, services: NodeServices | None, node_id: str) -> LedgerMirror | None:
    """The leader's etcd copy of the checkpointed sample ledger (node services only)."""
    if services is None:
        return None
    root = run_memory_dir(run_id)

    def members() -> set[str] | None:
        current = services.pending_round
        return None if current is None else set(current.members)

    def member_servers() -> list:
        held = members()
        return [p for p in ckpt_hooks.peer_endpoints(services) or [] if held is None or p.node in held]

    return LedgerMirror(
        node_id,
        node_dir=lambda: root / services.node_id,  # the id changes when the node rejoins
        publish=services.publish_ledger,
        leading=lambda: services.leading,
        peers=member_servers,
        member=lambda: services.node_id in (members() or ()),
    )
