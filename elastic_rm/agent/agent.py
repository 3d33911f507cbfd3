"""``ElasticRMAgent``: torch's ``LocalElasticAgent`` plus what elastic-rm needs on each node.

What it adds:
- a resource monitor (CPU, memory, GPUs, per-worker RSS/CPU) and the workers' step times (a local
  channel, no etcd connection per worker), published once a second to ``metrics/<node>`` in etcd and on
  an optional HTTP endpoint (``/healthz``, Prometheus ``/metrics``);
- draining: before torch restarts healthy workers for a new round, workers that use
  ``elastic_rm.train.report`` are asked to stop at the next step boundary (after their final
  checkpoint hook) within a grace period; then torch stops whatever is left, as it always does;
- lost-peer handling: workers whose collectives fail because a member vanished are restarted into the
  next round without using one of ``--max-restarts``.

Extension points (anchors.md, B.3): ``_start_workers``, ``_monitor_workers`` and ``_restart_workers``
are private torch methods (``_shutdown`` is not ours to hook: torch calls it on every worker stop); ``tests/launcher/test_torch_contract.py`` pins them so that a
torch upgrade that changes them fails loudly instead of silently skipping our hooks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from ..rendezvous.etcd_store import RoundSupersededError
from ..wire.channel import ENV_ROUND
from ..wire.metrics import encode_record
from . import ckpt_server
from .channel import AgentChannel
from .http import AgentHttpServer
from .inplace import InPlaceRounds
from .monitor import ResourceMonitor
from .record import build_record

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

    def validate(self) -> None:
        if self.sample_interval_s <= 0:
            raise ValueError(f"--sample-interval must be > 0 seconds, got {self.sample_interval_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace must be >= 0 seconds, got {self.drain_grace_s}")
        if self.membership_grace_s is not None and self.membership_grace_s < 0:
            raise ValueError(f"--membership-grace must be >= 0 seconds, got {self.membership_grace_s}")
        if not self.event_sample_interval_s >= 0:
            raise ValueError(
                f"--event-sample-interval must be >= 0 seconds (0: off), got {self.event_sample_interval_s}"
            )


class ElasticRMAgent(LocalElasticAgent):
    def __init__(self, *args: Any, options: AgentOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.options = options or AgentOptions()
        self.options.validate()
        handler = self._worker_group.spec.rdzv_handler
        self._handler = handler
        self.node_id = getattr(handler, "node_id", None) or self.options.node_id or "node"
        from ..obs.metrics import AgentMetrics

        self.metrics = AgentMetrics(self.node_id)
        self.events = self._event_log(handler)
        self.http = AgentHttpServer(
            self.metrics, self.options.metrics_port, self.options.metrics_host, self._health
        )
        self.http.start()  # a port in use fails here, before any worker or thread exists
        # peers fetch and replicate flash checkpoints through it; published in this node's record
        self.ckpt_server = ckpt_server.start_for_agent(handler, handler.get_run_id())
        self.monitor = ResourceMonitor(interval_s=self.options.sample_interval_s)
        self.channel = AgentChannel(window_s=STEP_WINDOW_S)
        self.in_place = InPlaceRounds(self.channel, self.events)  # workers that keep their processes
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="erm-metrics", daemon=True)
        self._started = False
        self._closed = False
        self._next_sample = 0.0  # monotonic time of the next "sample" event
        self._last_checkpoint = 0  # the newest flash checkpoint step reported as a "checkpoint" event
        self._publish_errors: set[str] = set()  # metrics-loop errors already logged as warnings
        self.ledger_mirror = self._ledger_mirror(handler)
        self.last_record: dict[str, Any] | None = None  # the newest metrics record (ermrun's status line)

    def _event_log(self, handler: Any):
        """The rendezvous handler's event log (etcd) when it has one, else a local one (torch's backends);
        plus the --event-log file."""
        from ..obs.events import EventLog

        events = getattr(handler, "events", None)
        if not isinstance(events, EventLog):
            events = EventLog(handler.get_run_id(), self.node_id)
        if self.options.event_log:
            try:
                events.attach_file(self.options.event_log)
            except OSError as exc:
                raise ValueError(
                    f"--event-log {self.options.event_log}: cannot append to it ({exc})"
                ) from exc
        return events

    def _ledger_mirror(self, handler: Any):
        """The leader's etcd copy of the checkpointed sample ledger, for handlers that can write it."""
        from ..train.paths import run_memory_dir
        from .ledger_mirror import LedgerMirror

        if not hasattr(handler, "publish_ledger"):
            return None
        root = run_memory_dir(handler.get_run_id())
        return LedgerMirror(
            self.node_id,
            node_dir=lambda: root / handler.node_id,  # the id changes when the node rejoins
            publish=handler.publish_ledger,
            leading=lambda: handler.leading,
            peers=lambda: ckpt_server.peer_endpoints(handler),
        )

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
        self._stop.set()
        if self._started:
            self._publisher.join(timeout=5)
            self.monitor.stop()
            self.channel.close()
        self.http.stop()
        if self.ckpt_server is not None:
            self.ckpt_server.stop()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        state = self._worker_group.state
        ok = state not in (WorkerState.FAILED, WorkerState.UNKNOWN)
        return ok, {"node": self.node_id, "state": str(state.value if hasattr(state, "value") else state)}

    # -- metrics ----------------------------------------------------------------------------------------

    def _publish_loop(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
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
        record = build_record(self.node_id, resources, self.channel.summary())
        self.last_record = record
        self.metrics.update(record)
        self.metrics.add_steps(self.channel.steps_total)
        completed = getattr(self._handler, "joined_round", None)
        if completed is not None:
            self.metrics.set_round(completed.round)
        self.metrics.set_state(str(self._worker_group.state.value).lower())
        publish = getattr(self._handler, "publish_metrics", None)
        if publish is not None:
            publish(encode_record(record))
        self._note_checkpoints()
        if self.ledger_mirror is not None:
            mirrored = self.ledger_mirror.poll()
            if mirrored is not None:
                log.debug("ledger of step %d mirrored: %d samples done", mirrored.step, mirrored.samples_done)
        interval = self.options.event_sample_interval_s
        if interval > 0 and completed is not None and time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + interval
            self._emit_sample(record, completed)

    def _note_checkpoints(self) -> None:
        """A "checkpoint" event for each new flash checkpoint this node's workers committed in its memory
        (a step directory with its manifest): seen from the agent, so workers need no extra channel."""
        from ..train.manifest import MANIFEST, committed_steps, step_dirname
        from ..train.paths import run_memory_dir

        node = getattr(self._handler, "node_id", None) or self.node_id
        node_dir = run_memory_dir(self._worker_group.spec.rdzv_handler.get_run_id()) / node
        committed = [
            s
            for s in committed_steps(node_dir)
            if s > self._last_checkpoint and (node_dir / step_dirname(s) / MANIFEST).is_file()
        ]
        if committed:
            self._last_checkpoint = committed[-1]
            self.events.emit(
                "checkpoint",
                f"flash checkpoint of step {committed[-1]} committed in node memory",
                step=committed[-1],
                directory=str(node_dir),
            )

    def _emit_sample(self, record: dict[str, Any], completed: Any) -> None:
        """A compact "sample" event: what ``erm report`` plots per node and ``erm status`` measures gains
        with (etcd keeps only each node's latest ``metrics/<node>``)."""
        steps = record.get("steps") or {}
        members = list(completed.members)
        rate = steps.get("samples_per_s")
        self.events.emit(
            "sample",
            f"round {completed.round}: " + (f"{rate:,.0f} samples/s" if rate is not None else "no steps"),
            round=completed.round,
            world=len(members),
            rank=members.index(self.node_id) if self.node_id in members else None,
            cpu=round(record["cpu"]["util_mean"], 4),
            mem_used_bytes=record["mem"]["used_bytes"],
            mem_total_bytes=record["mem"]["total_bytes"],
            gpu_util=[None if g["util"] is None else round(g["util"], 4) for g in record["gpus"]],
            samples_per_s=rate,
            step_p50_s=steps.get("p50_s"),
        )

    # -- torch hooks ------------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous and rank exchange, once more when a member died right after the round was
        sealed: the exchange then waits for the dead member in the round's store, a newer round (without
        it) ends that wait (RoundSupersededError), and this node joins the newer round."""
        for attempt in range(1, MAX_SUPERSEDED_ROUNDS + 1):
            try:
                return super()._rendezvous(worker_group)
            except RoundSupersededError as exc:
                if attempt == MAX_SUPERSEDED_ROUNDS:
                    raise
                log.warning("%s (attempt %d)", exc, attempt)
                self.events.emit("round", "round superseded during the rank exchange; joining the newer one")

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Workers inherit this process's environment: the channel's directory and this node's id
        (the flash checkpoint keeps each node's copy under its node id)."""
        self._start_side_services()
        os.environ.update(self.channel.env())
        os.environ["ERM_NODE_ID"] = getattr(self._handler, "node_id", None) or self.node_id
        ckpt_server.set_worker_env(self._handler)  # this round's peers' checkpoint servers
        joined = getattr(self._handler, "joined_round", None)
        os.environ[ENV_ROUND] = str(joined.round if joined is not None else 0)
        self.channel.clear_drain()
        self.channel.reset_steps()  # a new world: step times of the old one would blur the planner's view
        pids = super()._start_workers(worker_group)
        self.monitor.set_pids(pids.values())
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A new round while the workers are healthy: drain them at a step boundary first, when the new round
        keeps all our peers (a scale-up, a planned change). When a peer is gone, a worker waiting on it in a
        collective never reaches a step boundary: stop at once, as torch does."""
        keeps_peers = getattr(self._handler, "peers_all_kept", lambda: True)()
        drain = (
            worker_group.state == WorkerState.HEALTHY
            and keeps_peers
            and self.options.drain_grace_s > 0
            and self._started
        )
        if not drain and self._started and worker_group.state == WorkerState.HEALTHY:
            why = "a peer left (its collectives cannot finish)" if not keeps_peers else "--drain-grace 0"
            self.events.emit("drain", f"drain skipped: {why}; stopping workers", skipped=True, reason=why)
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
            if self.in_place.run(self, worker_group, result):
                return  # the workers moved into the new round in place (elastic_rm.agent.inplace)
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitor, except that a failure caused by a lost peer becomes a membership restart.

        When a member node dies, the survivors' collectives fail at once, long before its lease expires.
        torch would count that against --max-restarts (and, at 0, end the job). We wait up to the
        membership grace for the rendezvous to show a newer round; if it does, we report HEALTHY so that
        torch's loop sees ``num_nodes_waiting() > 0`` and re-rendezvous without using a restart.
        """
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = worker_group.spec.rdzv_handler
        deadline = time.monotonic() + self._membership_grace(handler)
        while time.monotonic() < deadline:
            if handler.is_closed():
                break
            if handler.num_nodes_waiting() > 0:
                log.info("workers failed while the membership changed: re-rendezvous without using a restart")
                self._emit_failure(result, "the membership changed: re-rendezvous without using a restart")
                return RunResult(state=WorkerState.HEALTHY)
            time.sleep(0.05)
        left = self._remaining_restarts
        self._emit_failure(result, f"{left} restart(s) left" if left > 0 else "no restarts left")
        return result

    def _emit_failure(self, result: RunResult, outcome: str) -> None:
        failures = sorted(result.failures.items())
        ranks = [rank for rank, _ in failures]
        codes = [f.exitcode for _, f in failures]
        self.events.emit(
            "failure",
            f"worker group {str(result.state.value).lower()}: rank(s) {ranks} exit code(s) {codes}; {outcome}",
            state=str(result.state.value).lower(),
            ranks=ranks,
            exit_codes=codes,
            outcome=outcome,
        )

    def _membership_grace(self, handler: Any) -> float:
        if self.options.membership_grace_s is not None:
            return self.options.membership_grace_s
        settings = getattr(handler, "settings", None)
        return float(settings.lease_ttl) + 1.0 if hasattr(settings, "lease_ttl") else 0.0
