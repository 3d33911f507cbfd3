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

from .channel import AgentChannel
from .http import AgentHttpServer
from .metrics_record import build_record, encode_record
from .monitor import ResourceMonitor

log = logging.getLogger(__name__)

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

    def validate(self) -> None:
        if self.sample_interval_s <= 0:
            raise ValueError(f"--sample-interval must be > 0 seconds, got {self.sample_interval_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace must be >= 0 seconds, got {self.drain_grace_s}")
        if self.membership_grace_s is not None and self.membership_grace_s < 0:
            raise ValueError(f"--membership-grace must be >= 0 seconds, got {self.membership_grace_s}")


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
        self.http = AgentHttpServer(
            self.metrics, self.options.metrics_port, self.options.metrics_host, self._health
        )
        self.http.start()  # a port in use fails here, before any worker or thread exists
        self.monitor = ResourceMonitor(interval_s=self.options.sample_interval_s)
        self.channel = AgentChannel()
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="erm-metrics", daemon=True)
        self._started = False
        self._closed = False

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
                log.debug("metrics publish failed: %s", exc)

    def _publish_once(self) -> None:
        resources = self.monitor.summary()
        if resources is None:
            return
        record = build_record(self.node_id, resources, self.channel.summary())
        self.metrics.update(record)
        self.metrics.add_steps(self.channel.steps_total)
        completed = getattr(self._handler, "completed_round", None)
        if completed is not None:
            self.metrics.set_round(completed.round)
        self.metrics.set_state(str(self._worker_group.state.value).lower())
        publish = getattr(self._handler, "publish_metrics", None)
        if publish is not None:
            publish(encode_record(record))

    # -- torch hooks ------------------------------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Workers inherit this process's environment: the channel's directory and this node's id
        (the flash checkpoint keeps each node's copy under its node id)."""
        self._start_side_services()
        os.environ.update(self.channel.env())
        os.environ["ERM_NODE_ID"] = getattr(self._handler, "node_id", None) or self.node_id
        self.channel.clear_drain()
        pids = super()._start_workers(worker_group)
        self.monitor.set_pids(pids.values())
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A new round while the workers are healthy: drain them at a step boundary first, when the new round
        keeps all our peers (a scale-up, a planned change). When a peer is gone, a worker waiting on it in a
        collective never reaches a step boundary: stop at once, as torch does."""
        keeps_peers = getattr(self._handler, "peers_all_kept", lambda: True)()
        if (
            worker_group.state == WorkerState.HEALTHY
            and keeps_peers
            and self.options.drain_grace_s > 0
            and self._started
        ):
            self.metrics.set_state("draining")
            t0 = time.monotonic()
            self.channel.request_drain()
            pids = [w.id for w in worker_group.workers if w.id is not None]
            result = self.channel.wait_for_acks(timeout_s=self.options.drain_grace_s, pids=pids)
            log.info(
                "drained %d worker(s) at step boundaries in %.2fs (%d without the API, %d missing)",
                len(result.acked),
                time.monotonic() - t0,
                len(result.unregistered),
                len(result.missing),
            )
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
                return RunResult(state=WorkerState.HEALTHY)
            time.sleep(0.05)
        return result

    def _membership_grace(self, handler: Any) -> float:
        if self.options.membership_grace_s is not None:
            return self.options.membership_grace_s
        settings = getattr(handler, "settings", None)
        return float(settings.lease_ttl) + 1.0 if hasattr(settings, "lease_ttl") else 0.0
